"""Mixture of experts (course_lib.expert_parallel): routing, capacity, the load-balancing loss, and expert
parallelism on 2 and 4 ranks equal to one process holding every expert.

    .venv/bin/python -m pytest -q tests/expert_parallel/test_moe.py
"""

import math

import pytest
import torch

from course_lib.expert_parallel import MoE, capacity, load_balancing_loss, moe_reference, moe_run, route
from course_lib.runtime.launch import launch


def test_route_fills_each_expert_up_to_its_capacity_first_choices_first():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [3.0, 2.0, 0.0], [0.0, 3.0, 2.0]])
    experts, weights, slots, probs = route(logits, top_k=2, capacity_per_expert=2)
    assert experts.tolist() == [[0, 1], [0, 2], [0, 1], [1, 2]]
    # expert 0: tokens 0 and 1 take its 2 slots, token 2's first choice is dropped; expert 1: token 3's first
    # choice, then the second choices of tokens 0 and 2 (the latter dropped)
    assert slots.tolist() == [[0, 1], [1, 0], [-1, -1], [0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))
    assert capacity(tokens=4, n_experts=3, top_k=2, capacity_factor=1.0) == 3


def test_load_balancing_loss_is_one_when_uniform_and_grows_with_imbalance():
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None]).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(4 * 0.7)


def test_moe_without_dropping_is_the_weighted_sum_of_the_chosen_experts():
    torch.manual_seed(0)
    moe = MoE(d_model=8, hidden=16, n_experts=4, top_k=2, capacity_factor=4.0)  # C = 2 * tokens: nothing dropped
    x = torch.randn(6, 8)
    out, _ = moe(x)
    probs = torch.softmax(moe.router(x), -1)
    top, chosen = probs.topk(2, -1)
    expected = torch.stack([sum(top[t, j] / top[t].sum() * moe.experts[chosen[t, j]](x[t]) for j in range(2))
                            for t in range(6)])
    torch.testing.assert_close(out, expected)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_equals_one_process(tmp_path, world_size):
    ranks = launch(moe_run, world_size, log_dir=tmp_path, echo=False, timeout_s=120, threads_per_rank=1)
    reference = moe_reference(world_size)
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), reference["out"])
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), reference["x_grad"])
    for r in ranks:
        torch.testing.assert_close(r["router_grad"], reference["grads"]["router.weight"])
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], msg=f"rank {r['rank']}: {name}")
        assert r["aux_mean"] == pytest.approx(reference["aux"])
        stats = r["stats"]
        assert stats["kept"] + stats["dropped"] == stats["assignments"] == 24 * 2
        assert stats["capacity"] == math.ceil(1.0 * 24 * 2 / 4)
        buffer = 4 * stats["capacity"] * 16  # (E, C, d): each all-to-all keeps 1/N of it at home
        assert stats["elements_sent_per_all_to_all"] == buffer * (world_size - 1) // world_size
    assert sum(r["stats"]["dropped"] for r in ranks) > 0, "capacity factor 1.0 drops some assignments here"
    assert sum(len(r["grads"]) for r in ranks) == 4 * 4  # every expert's 4 tensors, each on one rank

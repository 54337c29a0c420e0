"""The expert-parallel exercise's worker (course_lib/expert_parallel/exercise_workers.py) measures what an answer
does on real ranks: its output and gradients against one process, and every collective it calls, in forward and
in backward (F/02b's tests run through it).

    .venv/bin/python -m pytest -q tests/expert_parallel/test_exercise_workers.py
"""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib.expert_parallel import check_expert_parallel, moe_reference
from course_lib.runtime.launch import RankFailure, launch

pytestmark = pytest.mark.distributed


def library_layer(x, router, experts, n_experts, top_k, capacity_factor, route):
    from course_lib.expert_parallel import ExpertParallelMoE, MoE

    moe = MoE(x.shape[1], experts[0].up.out_features, n_experts, top_k, capacity_factor)
    layer = ExpertParallelMoE(moe)
    layer.router, layer.experts = router, experts
    return layer(x)


def every_expert_everywhere(x, router, experts, n_experts, top_k, capacity_factor, route):
    """No all-to-all: the tokens are all-gathered and each rank returns only what its own experts computed."""
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.detach())
    c = math.ceil(capacity_factor * x.shape[0] * top_k / n_experts)
    chosen, weights, slots, probs = route(router(x), top_k, c)
    first = dist.get_rank() * len(experts)
    out = torch.zeros_like(x)
    for j, expert in enumerate(experts):
        token, choice = torch.nonzero((chosen == first + j) & (slots >= 0), as_tuple=True)
        out = out.index_add(0, token, expert(x[token]) * weights[token, choice, None])
    return out, probs.sum() * 0


def one_output(x, router, experts, n_experts, top_k, capacity_factor, route):
    return x


@pytest.fixture(autouse=True)
def forked(monkeypatch):  # the answers above are this file's functions: forked ranks have them
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "fork")


@pytest.mark.parametrize("size", [2, 4])
def test_the_library_equals_one_process_with_two_all_to_alls_each_way(tmp_path, size):
    ranks = launch(check_expert_parallel, size, args=(library_layer,), log_dir=tmp_path, timeout_s=60, echo=False)
    reference = moe_reference(world_size=size)
    rows = reference["out"].shape[0] // size
    for r in ranks:
        part = slice(r["rank"] * rows, (r["rank"] + 1) * rows)
        torch.testing.assert_close(r["out"], reference["out"][part])
        torch.testing.assert_close(r["x_grad"], reference["x_grad"][part])
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name])
        torch.testing.assert_close(r["router_grad"], reference["grads"]["router.weight"])
        assert math.isclose(r["aux_mean"], reference["aux"], rel_tol=1e-6)
        buffer = r["n_experts"] * r["routing"]["capacity"] * r["d_model"]
        for phase in ("forward", "backward"):
            assert [(c["name"], c["numel"]) for c in r["calls"] if c["phase"] == phase] == [("all_to_all_single", buffer)] * 2
        assert sum(r["routing"]["to_rank"]) == r["routing"]["kept"]


def test_other_collectives_and_missing_work_are_seen(tmp_path):
    ranks = launch(check_expert_parallel, 2, args=(every_expert_everywhere,), log_dir=tmp_path, timeout_s=60,
                   echo=False)
    reference = moe_reference(world_size=2)
    assert all([c["name"] for c in r["calls"]] == ["all_gather"] for r in ranks)
    with pytest.raises(AssertionError):  # a rank's tokens never reach the other rank's experts
        torch.testing.assert_close(ranks[0]["out"], reference["out"][:24])


def test_a_wrong_return_is_named(tmp_path):
    with pytest.raises(RankFailure, match=r"must return \(output, aux_loss\)"):
        launch(check_expert_parallel, 2, args=(one_output,), log_dir=tmp_path, timeout_s=60, echo=False)

"""ZeRO stages 0-3 from scratch train exactly like torch DDP and like one process on the global batch.

    .venv/bin/python -m pytest -q tests/sharding/test_zero.py

One launch per world size runs torch DDP and every stage in turn (rank start-up costs more than training).
The ranks start from different random weights (seed + rank): ZeRO's initial broadcast must fix that.
"""

import pytest
import torch
import torch.nn as nn

from course_lib.core.model import GPT, GPTConfig
from course_lib.data_parallel.collectives import shard_numel
from course_lib.runtime.launch import launch
from course_lib.runtime.spawn import single_process_group
from course_lib.sharding import apply_zero
from course_lib.sharding.zero import FlatLayout, ShardedAdamW, ZeroOptimizer
from course_lib.sharding.zero_workers import make_model, reference_run, zero_parity_run

STEPS = 3


@pytest.fixture(scope="module")
def reference():
    return reference_run(steps=STEPS)


def test_layout_pads_and_splits_the_flat_vector():
    layout = FlatLayout(numels=(4, 3, 3), parts=4, index=3)  # P = 10, N = 4: S = 3, 2 elements of padding
    assert (layout.numel, layout.shard_numel, layout.start) == (10, shard_numel(10, 4), 9)
    assert layout.pieces(4, 7) == [(4, 4), (4, 6), (6, 7), (7, 7)]  # the second parameter spans ranks 1 and 2
    tensors = [torch.arange(4.0), torch.arange(4.0, 7.0), torch.arange(7.0, 10.0)]
    torch.testing.assert_close(layout.my_shard(tensors, torch.float32), torch.tensor([9.0, 0.0, 0.0]))
    flat = torch.arange(12.0)
    out = [torch.empty(2, 2), torch.empty(3), torch.empty(3)]
    layout.unflatten_into(flat, out)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in out]), flat[:10])


def test_sharded_adamw_equals_torch_adamw():
    torch.manual_seed(0)
    weights = [torch.randn(3, 4), torch.randn(5)]
    torch_params = [nn.Parameter(w.clone()) for w in weights]
    optimizer = torch.optim.AdamW([{"params": [torch_params[0]], "weight_decay": 0.1},
                                   {"params": [torch_params[1]], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    flat = torch.cat([w.reshape(-1) for w in weights])
    adam = ShardedAdamW(flat.numel(), [(0, 12, 0.1), (12, 17, 0.0)], lr=1e-2, betas=(0.9, 0.95))
    for _ in range(4):
        grads = [torch.randn_like(w) for w in weights]
        for param, grad in zip(torch_params, grads):
            param.grad = grad
        optimizer.step()
        adam.step(flat, torch.cat([g.reshape(-1) for g in grads]))
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1) for p in torch_params]))
    assert not torch.equal(flat[:12], weights[0].reshape(-1))  # it did move


@pytest.mark.distributed
@pytest.mark.parametrize("world_size, stages", [(2, (0, 1, 2, 3)), (4, (1, 2, 3))])
def test_zero_equals_ddp_and_one_process(tmp_path, reference, world_size, stages):
    ranks = launch(zero_parity_run, world_size, kwargs=dict(stages=stages, steps=STEPS), log_dir=tmp_path,
                   echo=False, threads_per_rank=1)
    initial = dict(make_model(0).named_parameters())
    n_params = sum(p.numel() for p in initial.values())
    for result in ranks:
        ddp = result["ddp"]
        for name, param in reference["params"].items():
            torch.testing.assert_close(ddp["params"][name], param, msg=f"torch DDP, rank {result['rank']}: {name}")
        for stage in stages:
            zero, where = result[(stage, "fp32")], f"ZeRO-{stage}, rank {result['rank']} of {world_size}"
            for name, param in reference["params"].items():
                torch.testing.assert_close(zero["params"][name], ddp["params"][name], msg=f"{where}: {name} vs DDP")
                torch.testing.assert_close(zero["params"][name], param, msg=f"{where}: {name} vs one process")
            moved = max((zero["params"][n] - p).abs().max().item() for n, p in initial.items())
            assert moved > 1e-4, f"{where}: parameters did not change in {STEPS} steps"
            # Communication of the last step, in elements (ZeRO paper accounting): 2 Psi, or 3 Psi for stage 3
            # plus one more gather of the tied embedding (used twice in forward, by tok_emb and by lm_head).
            volume = sum(zero["comm_volume"].values())
            padded = shard_numel(n_params, world_size) * world_size
            expected = {0: 2 * n_params,                # all-reduce: 2 Psi
                        1: 2 * padded,                  # reduce-scatter, all-gather (padded flat vector)
                        2: n_params + padded,           # reduce-scatter per parameter, all-gather
                        3: 3 * n_params + initial["tok_emb.weight"].numel()}[stage]
            assert volume == expected, f"{where}: communication volume {zero['comm_volume']}"
            # During backward, stages 0 and 1 end with every full gradient alive; 2 and 3 free each one at once.
            full_grads = n_params * 4
            if stage <= 1:
                assert zero["peak_full_grad_bytes"] == full_grads, where
            else:
                assert 0 < zero["peak_full_grad_bytes"] < full_grads / 2, where
        if 3 in stages:  # ZeRO-3 never held more than a unit or two of full parameters at once
            assert 0 < result[(3, "fp32")]["peak_gathered_bytes"] < n_params * 4 / 1.5
    for stage in stages:  # ranks see different rows; the mean of their losses is the global batch's loss
        first = torch.tensor([r[(stage, "fp32")]["losses"][0] for r in ranks])
        assert first.std() > 0
        torch.testing.assert_close(first.mean().item(), reference["losses"][0], rtol=1e-5, atol=1e-6)


def test_bad_input_gets_a_clear_error():
    model = GPT(GPTConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match="stage must be one of"):
        apply_zero(model, 5, lr=1e-3)
    with pytest.raises(ValueError, match="precision must be one of"):
        apply_zero(model, 1, lr=1e-3, precision="fp16")
    with pytest.raises(ValueError, match="lr > 0"):
        apply_zero(model, 1, lr=0.0)
    with pytest.raises(ValueError, match="no trainable parameters"):
        apply_zero(nn.Sequential(nn.ReLU()), 1, lr=1e-3)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        apply_zero(GPT(GPTConfig.from_preset("tiny", activation_checkpointing=True)), 3, lr=1e-3)
    with pytest.raises(RuntimeError, match="needs a process group"):
        apply_zero(model, 2, lr=1e-3)
    with single_process_group():
        for stage in (1, 2, 3):
            zero = apply_zero(GPT(GPTConfig.from_preset("tiny")), stage, lr=1e-3)
            with pytest.raises(RuntimeError, match="backward"):
                zero.step()  # no backward ran: there is no gradient to average
        with pytest.raises(ValueError, match="belong to no ZeRO-3 unit"):
            apply_zero(GPT(GPTConfig.from_preset("tiny")), 3, lr=1e-3, units=[])
        with pytest.raises(ValueError, match="Zero3Optimizer"):
            ZeroOptimizer(GPT(GPTConfig.from_preset("tiny")), 3, lr=1e-3)  # the stage 1-2 class cannot do 3

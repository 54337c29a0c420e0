"""Tensor parallelism with DTensor (course_lib.tensor_parallel.dtensor) on a CUDA device mesh over NCCL equals one
process holding the whole model: logits, loss, gradients, parameters after AdamW steps.

    pytest -m multigpu tests/multigpu/test_tensor_parallel_nccl.py
"""

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]
STEPS, BATCH, SEQ_LEN, LR = 3, 4, 32, 1e-3
N_EMBD = 64  # the tiny preset: 4 heads, ffn_hidden 128
RUNS = {"dtensor": {}, "dtensor + sequence parallel": {"sequence_parallel": True}}


def test_dtensor_tensor_parallel_equals_one_process(multigpu, tmp_path):
    from course_lib.tensor_parallel.workers import dtensor_tp_run, reference_run

    world_size = multigpu.world_size(2, 4)  # the heads and the hidden width divide by them
    settings = dict(steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, lr=LR)
    ranks = multigpu.launch({name: (dtensor_tp_run, dict(settings, **options)) for name, options in RUNS.items()},
                            world_size, tmp_path)
    reference = reference_run(**settings)
    for name in RUNS:
        for rank, result in enumerate(ranks):
            run, where = result[name], f"{name}, rank {rank} of {world_size}"
            assert run["tp"] == world_size and run["tp_rank"] == rank, where
            assert run["q_proj_placements"] == "(Shard(dim=0),)", where
            assert run["q_proj_local_shape"] == (N_EMBD // world_size, N_EMBD), where
            torch.testing.assert_close(run["logits"], reference["logits"], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{where}: first-step logits: {m}")
            multigpu.assert_losses_close(run["losses"], reference["losses"], where=where)
            multigpu.assert_grads_close(run["grads"], reference["grads"], where=f"{where}, first step")
            multigpu.assert_adamw_params_close(run["params"], reference["params"], LR, STEPS, where=where)

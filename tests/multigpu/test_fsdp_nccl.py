"""FSDP2 (fully_shard, course_lib.sharding.fsdp.apply_fsdp) with its shards on the GPUs over NCCL equals one process.

    pytest -m multigpu tests/multigpu/test_fsdp_nccl.py
"""

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]
STEPS, ROWS_PER_RANK, SEQ_LEN, LR = 3, 2, 32, 0.5
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


def test_fsdp2_steps_equal_one_process(multigpu, tmp_path):
    from course_lib.parallel.multigpu_workers import fsdp_train_on_device
    from course_lib.parity import seeded_gpt
    from course_lib.sharding.fsdp_workers import train_one_process

    world_size = multigpu.world_size(2, 4)
    settings = dict(steps=STEPS, rows_per_rank=ROWS_PER_RANK, seq_len=SEQ_LEN, lr=LR, grad_clip=1.0)
    ranks = multigpu.launch({strategy: (fsdp_train_on_device, dict(strategy=strategy, **settings))
                             for strategy in STRATEGIES}, world_size, tmp_path)
    # one process, every rank's rows in each global batch, SGD with the same clipping
    reference = train_one_process(world_size=world_size, optimizer="sgd", **settings)
    initial = dict(seeded_gpt(0).named_parameters())
    for strategy in STRATEGIES:
        for rank, result in enumerate(ranks):
            run, where = result[strategy], f"{strategy}, rank {rank} of {world_size}"
            assert run["shard_device"].startswith(multigpu.device_type), (where, run["shard_device"])
            assert run["mesh_device_type"] == multigpu.device_type, (where, run["mesh_device_type"])
            multigpu.assert_sgd_params_close(run["params"], reference["params"], where=where)
            moved = max((run["params"][n] - p.detach()).abs().max().item() for n, p in initial.items())
            assert moved > 1e-4, f"{where}: the parameters did not change in {STEPS} steps"
        local = torch.tensor([result[strategy]["losses"] for result in ranks], dtype=torch.float64)
        assert (local[:, 0] != local[0, 0]).any(), f"{strategy}: every rank saw the same rows"
        multigpu.assert_losses_close(local.mean(dim=0), reference["losses"], where=f"{strategy}: mean over the ranks")

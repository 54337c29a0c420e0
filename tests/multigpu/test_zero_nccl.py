"""ZeRO stages 1-3 from scratch (course_lib.sharding: reduce-scatter, all-gather, broadcast) on the GPUs over NCCL
equal one process.

    pytest -m multigpu tests/multigpu/test_zero_nccl.py
"""

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]
STEPS = 3
STAGES = (1, 2, 3)


def test_zero_stages_equal_one_process(multigpu, tmp_path):
    from course_lib.sharding.zero_workers import TRAINING, make_model, reference_run, zero_parity_run

    world_size = multigpu.world_size(2, 4, 8)  # a global batch of 8 rows
    ranks = multigpu.launch({"zero": (zero_parity_run, dict(stages=STAGES, steps=STEPS))}, world_size, tmp_path)
    reference = reference_run(steps=STEPS)
    initial = dict(make_model(0).named_parameters())
    for stage in STAGES:
        for rank, result in enumerate(ranks):
            run, where = result["zero"][(stage, "fp32")], f"ZeRO-{stage}, rank {rank} of {world_size}"
            multigpu.assert_adamw_params_close(run["params"], reference["params"], TRAINING["lr"], STEPS, where=where)
            moved = max((run["params"][n] - p.detach()).abs().max().item() for n, p in initial.items())
            assert moved > 1e-4, f"{where}: the parameters did not change in {STEPS} steps"
            for name, param in ranks[0]["zero"][(stage, "fp32")]["params"].items():  # gathered: the same everywhere
                assert torch.equal(run["params"][name], param), f"{where}: {name} differs from rank 0's"
        local = torch.tensor([result["zero"][(stage, "fp32")]["losses"] for result in ranks], dtype=torch.float64)
        assert (local[:, 0] != local[0, 0]).any(), f"ZeRO-{stage}: every rank saw the same rows"
        multigpu.assert_losses_close(local.mean(dim=0), reference["losses"], where=f"ZeRO-{stage}: mean over ranks")

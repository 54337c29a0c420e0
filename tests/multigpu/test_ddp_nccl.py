"""torch DDP on one GPU per rank over NCCL: training steps and no_sync accumulation equal one process.

    pytest -m multigpu tests/multigpu/test_ddp_nccl.py
"""

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]
STEPS = 3
MICRO_BATCH, ACCUM, SEQ_LEN = 2, 3, 16


def test_torch_ddp_steps_and_accumulation_equal_one_process(multigpu, tmp_path):
    from course_lib.data_parallel.torch_ddp import no_sync_accumulation
    from course_lib.parity import global_batches, gradients, seeded_gpt
    from course_lib.sharding.zero_workers import TRAINING, ddp_run, reference_run

    world_size = multigpu.world_size(2, 4, 8)  # ddp_run's global batch of 8 rows splits over them
    ranks = multigpu.launch({
        # AdamW steps on this rank's rows; the ranks start from different weights: DDP's broadcast must fix that
        "train": (ddp_run, dict(steps=STEPS)),
        # one step of ACCUM micro-batches, under no_sync and with a sync after every micro-batch
        "accumulation": (no_sync_accumulation, dict(micro_batch=MICRO_BATCH, grad_accum_steps=ACCUM, seq_len=SEQ_LEN)),
    }, world_size, tmp_path)

    reference = reference_run(steps=STEPS)  # one process, the whole global batch of every step
    for rank, result in enumerate(ranks):
        multigpu.assert_adamw_params_close(result["train"]["params"], reference["params"], TRAINING["lr"], STEPS,
                                           where=f"DDP rank {rank} of {world_size}")
    for rank, result in enumerate(ranks[1:], start=1):  # replicas hold the same bits: same broadcast, same average
        for name, param in ranks[0]["train"]["params"].items():
            assert torch.equal(result["train"]["params"][name], param), f"rank {rank} and rank 0 differ in {name}"
    local = torch.tensor([result["train"]["losses"] for result in ranks], dtype=torch.float64)
    assert (local[:, 0] != local[0, 0]).any(), "every rank saw the same rows"
    multigpu.assert_losses_close(local.mean(dim=0), reference["losses"], where="mean of the ranks' losses")

    model = seeded_gpt(0, "tiny", block_size=SEQ_LEN)  # no_sync_accumulation's model and batch, in one process
    batch = global_batches(1, MICRO_BATCH * ACCUM * world_size, SEQ_LEN, 0)[0]
    model(batch, targets=batch)[1].backward()
    whole_batch = gradients(model)
    for rank, result in enumerate(ranks):
        variants = result["accumulation"]
        for variant in ("no_sync", "sync_every_micro_batch"):
            multigpu.assert_grads_close(variants[variant]["grads"], whole_batch,
                                        where=f"{variant}, rank {rank} of {world_size}")
        assert variants["sync_every_micro_batch"]["allreduces"] == ACCUM * variants["no_sync"]["allreduces"] > 0

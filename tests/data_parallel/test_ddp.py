"""Data parallelism from scratch, bucketed with overlap and torch DDP all equal one process."""

import pytest
import torch

from course_lib.data_parallel.workers import GRADIENT_SYNCS, data_parallel_run, ring_allreduce_check
from course_lib.runtime.launch import launch, run_each
from course_lib.parity import single_process_run

pytestmark = pytest.mark.distributed
STEPS = 3


@pytest.fixture(scope="module")
def reference():
    return single_process_run(steps=STEPS)


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_equals_single_process(tmp_path, reference, world_size):
    syncs = {sync: (data_parallel_run, dict(strategy=sync, steps=STEPS)) for sync in GRADIENT_SYNCS}
    ranks = launch(run_each, world_size, args=(syncs,), log_dir=tmp_path, echo=False)
    for strategy in GRADIENT_SYNCS:
        for rank_results in ranks:
            result = rank_results[strategy]
            where = f"{strategy}, rank {result['rank']} of {world_size}"
            for name, grad in reference["grads"].items():
                torch.testing.assert_close(result["grads"][name], grad, msg=f"{where}: first-step grad of {name}")
            for name, param in reference["params"].items():
                torch.testing.assert_close(result["params"][name], param, msg=f"{where}: {name} after {STEPS} steps")
        # Ranks see different rows, so their local losses differ, but their mean is the global loss.
        first_losses = torch.tensor([r[strategy]["losses"][0] for r in ranks])
        assert first_losses.std() > 0
        torch.testing.assert_close(first_losses.mean().item(), reference["losses"][0], rtol=1e-5, atol=1e-6)
    bucket_syncs = [kind for kind, *_ in ranks[0]["bucketed"]["timeline"] if kind == "allreduce"]
    assert len(bucket_syncs) > STEPS  # several buckets per step: communication was split and overlapped


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_all_reduce_equals_all_reduce(tmp_path, world_size):
    for rank_results in launch(ring_allreduce_check, world_size, log_dir=tmp_path, echo=False):
        for result in rank_results:
            torch.testing.assert_close(result["ring"], result["reference"], msg=f"numel {result['numel']}")

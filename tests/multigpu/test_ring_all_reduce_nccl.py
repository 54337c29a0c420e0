"""The course's ring all-reduce (course_lib.data_parallel.collectives.ring_all_reduce: isend/recv around the ring)
on GPU tensors over NCCL equals dist.all_reduce and the exact sum.

    pytest -m multigpu tests/multigpu/test_ring_all_reduce_nccl.py
"""

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]


def test_ring_all_reduce_equals_all_reduce_and_the_sum(multigpu, tmp_path):
    from course_lib.data_parallel.workers import rank_tensor
    from course_lib.parallel.multigpu_workers import RING_SHAPES, ring_all_reduce_on_device

    world_size = multigpu.world_size(*range(2, 9))  # any number of ranks makes a ring
    ranks = multigpu.launch({"ring": (ring_all_reduce_on_device, dict(shapes=RING_SHAPES))}, world_size, tmp_path)
    for index, shape in enumerate(RING_SHAPES):
        # every rank's fp32 input, summed in float64
        exact = sum(rank_tensor(r, shape, dtype=torch.float32).double() for r in range(world_size))
        for rank, result in enumerate(ranks):
            case = result["ring"][index]
            where = f"shape {shape}, rank {rank} of {world_size}"
            assert case["shape"] == shape and case["device"].startswith(multigpu.device_type), (where, case["device"])
            assert case["ring"].dtype == torch.float32 and case["ring"].shape == shape, where
            torch.testing.assert_close(case["ring"].double(), exact, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: ring vs the sum: {m}")
            torch.testing.assert_close(case["ring"], case["all_reduce"], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: ring vs dist.all_reduce: {m}")
            # Each chunk is summed on one rank and then only copied around the ring: every rank ends with the same bits.
            assert torch.equal(case["ring"], ranks[0]["ring"][index]["ring"]), f"{where}: differs from rank 0"

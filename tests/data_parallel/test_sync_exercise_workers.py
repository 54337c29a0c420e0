"""The workers that grade notebook 02b: course_lib's own algorithms pass them, and what they record is right.

    .venv/bin/python -m pytest -q tests/data_parallel/test_sync_exercise_workers.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib.data_parallel.ddp import BucketedDataParallel, allreduce_gradients
from course_lib.data_parallel.workers import (RING_SHAPES, check_gradient_sync, check_ring_all_reduce,
                                                            expected_bucket_sizes, sync_reference)
from course_lib.data_parallel.collectives import ring_all_reduce
from course_lib.runtime.launch import launch
from course_lib.parity import seeded_gpt


def library_buckets(model, bucket_cap_mb):
    """course_lib's BucketedDataParallel as a finish() function (what the exercise asks for)."""
    return BucketedDataParallel(model, bucket_cap_mb, broadcast=False).finish_gradient_sync


def assert_matches_reference(ranks, reference):
    for rank in ranks:
        for case in ("all", "frozen"):
            assert rank[case]["error"] is None
            for step, record in enumerate(rank[case]["steps"]):
                for name, expected in reference[case][step].items():
                    if expected is None:
                        assert record["grads"][name] is None
                    else:
                        torch.testing.assert_close(record["grads"][name], expected)


def test_the_library_passes_the_gradient_checks(tmp_path):
    reference = sync_reference(3)
    after = launch(check_gradient_sync, 3, args=(allreduce_gradients,), kwargs={"style": "after"},
                   log_dir=tmp_path / "after", timeout_s=60, threads_per_rank=1)
    assert_matches_reference(after, reference)
    calls = after[0]["all"]["steps"][0]["calls"]
    assert len(calls) == 20 and not any(c["in_backward"] or c["async"] for c in calls)  # after backward, blocking

    buckets = launch(check_gradient_sync, 3, args=(library_buckets,), kwargs={"style": "buckets"},
                     log_dir=tmp_path / "buckets", timeout_s=60, threads_per_rank=1)
    assert_matches_reference(buckets, reference)
    for case in ("all", "frozen"):
        for record in buckets[1][case]["steps"]:
            assert [c["numel"] for c in record["calls"]] == buckets[1][case]["bucket_sizes"]
            assert all(c["in_backward"] and c["async"] and c["waited"] for c in record["calls"])


def test_expected_buckets_follow_the_cap_in_reverse_order():
    model = seeded_gpt(0, "tiny")
    sizes = expected_bucket_sizes(model, 0.06)
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    # norm_f, the last block's down and up projections: the first gradients of backward, and the bucket closes
    # with the one that takes it to the cap (0.06 MiB = 15,728.6 fp32 numbers) or past it
    assert sizes[0] == 64 + 8192 + 8192
    assert all(4 * size >= 0.06 * 2**20 for size in sizes[:-1])
    assert expected_bucket_sizes(model, 1e-9) == [p.numel() for p in reversed(list(model.parameters()))]


def test_the_library_ring_passes_and_its_traffic_is_counted(tmp_path):
    ranks = launch(check_ring_all_reduce, 3, args=(ring_all_reduce,), log_dir=tmp_path, timeout_s=60,
                   threads_per_rank=1)
    for i, shape in enumerate(RING_SHAPES):
        numel = ranks[0]["cases"][i]["expected"].numel()
        assert sum(r["cases"][i]["sent_elements"] for r in ranks) == 2 * 2 * numel
        for rank in ranks:
            case = rank["cases"][i]
            assert case["error"] is None and case["returned_is_input"] and case["messages"] == 4
            torch.testing.assert_close(case["returned"], case["expected"])


def all_reduce_instead(tensor):
    dist.all_reduce(tensor)
    return tensor


def c10d_all_reduce_and_fake_traffic(tensor):
    """The sum by another name than dist.all_reduce, and 2(n - 1) messages sent for show."""
    from torch.distributed import distributed_c10d

    distributed_c10d.all_reduce(tensor)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for _ in range(2 * (world_size - 1)):
        request = dist.isend(torch.zeros(1), dst=(rank + 1) % world_size)
        dist.recv(torch.zeros(1), src=(rank - 1) % world_size)
        request.wait()
    return tensor


def process_group_all_reduce(tensor):
    from torch.distributed import distributed_c10d

    distributed_c10d._get_default_group().allreduce([tensor]).wait()
    return tensor


def backend_all_reduce(tensor):
    from torch.distributed import distributed_c10d

    backend = distributed_c10d._get_default_group()._get_backend(tensor.device)
    backend.allreduce([tensor]).wait()
    return tensor


def all_gather_then_sum(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    tensor.copy_(sum(parts))
    return tensor


def dtensor_redistribute(tensor):
    """A DTensor that is partial on every rank, made whole: torch's functional all-reduce, underneath."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    total = DTensor.from_local(tensor, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
    tensor.copy_(total)
    return tensor


@pytest.mark.parametrize("answer", [all_reduce_instead, c10d_all_reduce_and_fake_traffic, process_group_all_reduce,
                                    backend_all_reduce, all_gather_then_sum, dtensor_redistribute],
                         ids=lambda f: f.__name__)
def test_collectives_are_refused_in_the_ring_check_by_whatever_name(tmp_path, answer):
    ranks = launch(check_ring_all_reduce, 2, args=(answer,), log_dir=tmp_path, timeout_s=60, threads_per_rank=1)
    for rank in ranks:
        assert rank["cases"][0]["error"].startswith("CollectiveRefused: build the ring from dist.isend / dist.recv")
        assert len(rank["cases"]) == 1  # stopped at the first failure

"""assign_buckets (and so BucketedDataParallel and the DDP exercise's grader) groups gradients exactly as torch DDP.

    .venv/bin/python -m pytest -q tests/data_parallel/test_buckets.py

torch's rule lives in C++ (compute_bucket_assignment_by_size, bound as dist._compute_bucket_assignment_by_size):
the course's version must give the same buckets for any model, cap and first-bucket cap, and DDP itself, after
its first iteration, must rebuild its buckets by that rule in the order the gradients arrived.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from course_lib.data_parallel.ddp import BucketedDataParallel, assign_buckets
from course_lib.data_parallel.workers import expected_bucket_sizes
from course_lib.runtime.spawn import single_process_group
from course_lib.parity import seeded_gpt

MiB = 2**20


def mlp(mixed: bool = False) -> nn.Module:
    """An MLP with biases (tensors of very different sizes); `mixed`: its last layer in bf16, a second dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 200), nn.GELU(), nn.Linear(200, 200), nn.GELU(), nn.Linear(200, 10))
    if mixed:
        model[4].to(torch.bfloat16)
    return model


MODELS = {"tiny GPT": lambda: seeded_gpt(0, "tiny"), "small GPT": lambda: seeded_gpt(0, "small"), "MLP": mlp,
          "MLP, fp32 and bf16": lambda: mlp(mixed=True)}


def torch_buckets(params, limits):
    """torch's assignment of `params` taken in the order given, as DDP's rebuild calls it (no sorting)."""
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, tensor_indices=list(range(len(params))))
    return [list(bucket) for bucket in indices]


@pytest.mark.parametrize("model_name", MODELS)
def test_assign_buckets_equals_torch(model_name):
    params = list(reversed([p for p in MODELS[model_name]().parameters() if p.requires_grad]))  # backward's order
    total = sum(p.numel() * p.element_size() for p in params)
    caps = sorted({1, 1000, int(0.06 * MiB), int(0.25 * MiB), total // 3, total, 25 * MiB})
    for cap in caps:
        for first in (None, 1, int(0.02 * MiB), dist._DEFAULT_FIRST_BUCKET_BYTES):
            ours = assign_buckets(params, cap, first)
            theirs = torch_buckets(params, [cap] if first is None else [first, cap])
            where = f"{model_name}, cap {cap} bytes, first bucket cap {first}"
            if len({(p.dtype, p.device) for p in params}) == 1:
                assert ours == theirs, where
            else:  # several dtypes: torch lists the buckets left open in no defined order
                assert sorted(ours) == sorted(theirs), where
            assert sorted(i for bucket in ours for i in bucket) == list(range(len(params))), where


def test_a_bucket_closes_once_it_reaches_the_cap():
    sizes = [10, 30, 25, 100, 5, 5]  # fp32: 4 bytes each
    params = [torch.zeros(n) for n in sizes]
    assert assign_buckets(params, 4 * 40) == [[0, 1], [2, 3], [4, 5]]  # 40 reached exactly, then passed by 100
    assert assign_buckets(params, 4 * 40, first_bucket_cap_bytes=4 * 10) == [[0], [1, 2], [3], [4, 5]]
    assert assign_buckets(params, 0) == [[i] for i in range(len(sizes))]
    with pytest.raises(ValueError, match="negative"):
        assign_buckets(params, -1)


def test_the_exercise_grader_and_the_library_agree_with_torch():
    model = seeded_gpt(0, "tiny")
    params = list(reversed(list(model.parameters())))
    expected = [sum(params[i].numel() for i in bucket) for bucket in torch_buckets(params, [int(0.06 * MiB)])]
    assert expected_bucket_sizes(model, 0.06) == expected
    assert len(expected) == 6  # the DDP exercise's 0.06 MiB cap on the tiny GPT's 20 tensors
    with single_process_group():
        wrapped = BucketedDataParallel(model, bucket_cap_mb=0.06, broadcast=False)
        assert [bucket.numel for bucket in wrapped.buckets] == expected


@pytest.mark.parametrize("preset, bucket_cap_mb", [("tiny", 0.06), ("small", None), ("small", 1.0)])
def test_ddp_starts_with_one_bucket_and_rebuilds_by_the_same_rule(one_thread, preset, bucket_cap_mb):
    model = seeded_gpt(0, preset)
    params = list(model.parameters())
    index_of = {id(p): i for i, p in enumerate(params)}
    sent: list[list[list[int]]] = []  # per iteration, the buckets DDP all-reduced, as parameter indices

    def recording_hook(state, bucket):  # one rank: the sum over the ranks is the bucket itself
        sent[-1].append([index_of[id(p)] for p in bucket.parameters()])
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with single_process_group():
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        ddp.register_comm_hook(None, recording_hook)
        for _ in range(2):
            sent.append([])
            ddp(idx, targets=idx)[1].backward()
        logged = ddp._get_ddp_logging_data()["prev_iteration_grad_ready_order_indices"]  # '19, 18, 17, ...'
    order = [int(i) for i in logged.split(",")]  # the parameters in the order the first backward finished them
    assert sorted(sent[0][0]) == list(range(len(params))) and len(sent[0]) == 1  # first step: one bucket
    cap = 25 * MiB if bucket_cap_mb is None else int(bucket_cap_mb * MiB)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else None  # 1 MiB only for the default cap
    ours = [[order[i] for i in bucket] for bucket in assign_buckets([params[i] for i in order], cap, first)]
    assert sent[1] == ours  # rebuilt before the second forward pass, in the order the first backward ran
    if bucket_cap_mb == 0.06:
        assert [sum(params[i].numel() for i in bucket) for bucket in ours] == expected_bucket_sizes(model, 0.06)


def test_ddp_buckets_at_construction_only_when_it_looks_for_unused_parameters():
    model = seeded_gpt(0, "tiny")
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    with single_process_group():
        for kwargs in ({}, {"static_graph": True}, {"find_unused_parameters": True}):
            logged = DistributedDataParallel(model, bucket_cap_mb=0.06, **kwargs)._get_ddp_logging_data()
            sizes = [int(size) for size in logged["bucket_sizes"].split(",")]
            if kwargs.get("find_unused_parameters"):  # by the cap, in parameter order, listed last bucket first
                expected = [sum(params[i].numel() * params[i].element_size() for i in bucket)
                            for bucket in reversed(assign_buckets(params, int(0.06 * MiB)))]
                assert sizes == expected, kwargs
            else:
                assert sizes == [total], kwargs

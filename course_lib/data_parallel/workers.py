"""Rank workers for data parallelism: three ways, checked against one process.

    from course_lib.runtime.launch import launch
    from course_lib.data_parallel.workers import data_parallel_run
    from course_lib.parity import single_process_run
    ranks = launch(data_parallel_run, world_size=2, kwargs=dict(strategy="bucketed", steps=3))
    reference = single_process_run(steps=3)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.steps import train_step
from course_lib.data_parallel.ddp import BucketedDataParallel, allreduce_gradients, broadcast_parameters
from course_lib.data_parallel.collectives import ring_all_reduce
from course_lib.runtime.env import get_dist_info
from course_lib.parity import global_batches, gradients, local_rows, seeded_gpt

GRADIENT_SYNCS = ("naive", "bucketed", "torch_ddp")


def data_parallel_run(strategy: str = "naive", steps: int = 3, preset: str = "tiny", global_batch: int = 8,
                      seq_len: int = 32, seed: int = 0, bucket_cap_mb: float = 0.05) -> dict:
    """Each rank trains on its rows of the global batch and synchronises gradients with `strategy`.

    Returns this rank's first-step gradients, final parameters, per-step local losses and a timeline.
    """
    if strategy not in GRADIENT_SYNCS:
        raise ValueError(f"strategy must be one of {GRADIENT_SYNCS}, got {strategy!r}")
    info = get_dist_info()
    model = seeded_gpt(seed + info.rank, preset)  # different init per rank: the broadcast must fix it
    if strategy == "naive":
        broadcast_parameters(model)
        wrapped = model
    elif strategy == "bucketed":
        wrapped = BucketedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    first_grads, losses, timeline = [], [], []

    def synchronised_step(micro_batches):  # forward, backward and the sync of `strategy`, timed
        loss, intervals = timed_sync_step(model, wrapped, micro_batches[0])
        timeline.extend(intervals)
        return loss

    for batch in global_batches(steps, global_batch, seq_len, seed):
        keep_first = (lambda: first_grads.append(gradients(model))) if not first_grads else None
        stats = train_step(model, [local_rows(batch, info.rank, info.world_size)], optimizer,
                           forward_backward=synchronised_step, after_backward=keep_first, grad_norm=False)
        losses.append(stats["loss"])
    dist.barrier()
    return {"rank": info.rank, "grads": first_grads[0], "losses": losses, "timeline": timeline,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def timed_sync_step(model, wrapped, rows) -> tuple[torch.Tensor, list[tuple[str, float, float]]]:
    """Forward, backward and gradient sync of one data-parallel step; returns (loss, (kind, start, end) intervals).

    wrapped is model itself (the naive sync: every gradient's all_reduce after backward), a BucketedDataParallel
    (its all_reduces were launched during backward: wait for them) or torch's DDP (done inside backward).
    The intervals: forward, backward, the all-reduces as far as they can be seen, and a zero-length step_end.
    """
    model.zero_grad(set_to_none=True)
    start = time.monotonic()
    _, loss = wrapped(rows, targets=rows)
    forward_end = time.monotonic()
    loss.backward()
    backward_end = time.monotonic()
    if wrapped is model:
        allreduce_gradients(model)
        comm = [("allreduce", backward_end, time.monotonic())]
    elif isinstance(wrapped, BucketedDataParallel):
        first = len(wrapped.timeline)
        wrapped.finish_gradient_sync()
        comm = wrapped.timeline[first:]
    else:
        comm = []
    end = time.monotonic()
    return loss, [("forward", start, forward_end), ("backward", forward_end, backward_end), *comm, ("step_end", end, end)]


def ring_allreduce_check(numels=(1, 7, 1000), seed: int = 0) -> list[dict]:
    """Ring all-reduce and dist.all_reduce on the same random tensors; return both results per size."""
    info = get_dist_info()
    results = []
    for numel in numels:
        data = torch.randn(numel, generator=torch.Generator().manual_seed(seed + info.rank))
        reference = data.clone()
        dist.all_reduce(reference)
        results.append({"numel": numel, "ring": ring_all_reduce(data.clone()), "reference": reference})
    return results

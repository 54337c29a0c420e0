"""Data parallelism from scratch, naive first, then bucketed with overlap (as picotron's data_parallel.py).

Every rank holds a full replica and sees a different slice of the batch. After backward each gradient is
averaged over the ranks, so every replica takes the same optimizer step:

    g = (1 / world_size) * sum over ranks of g_rank

which equals the gradient of the mean loss over the concatenated global batch. Two ways to get there:

- `allreduce_gradients(model)`: after backward, one all_reduce per gradient (simple, no overlap);
- `BucketedDataParallel(model)`: gradient hooks pack ready gradients into buckets and launch an async
  all_reduce per bucket *during* backward, so communication of late layers overlaps the backward of early
  ones — what torch's DistributedDataParallel does.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> None:
    """Start every replica from rank src's weights (and buffers)."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=src, group=group)


def allreduce_gradients(model: nn.Module, group=None) -> None:
    """The naive synchronisation: sum each gradient over the ranks, then divide by the world size.

    A tensor-parallel gradient (a DTensor) is averaged as its local shard, over `group`: the data-parallel
    ranks that hold the same shard.
    """
    world_size = dist.get_world_size(group)
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            grad.div_(world_size)


def assign_buckets(params, bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None) -> list[list[int]]:
    """Which of `params` share a bucket: lists of indices into `params`, filled in the order given.

    torch DDP's rule (compute_bucket_assignment_by_size in its C++ reducer): each parameter is appended to the
    open bucket of its dtype and device, and that bucket closes as soon as it holds `bucket_cap_bytes` or more.
    A bucket therefore passes the cap by its last parameter, and a parameter larger than the cap closes its
    bucket at once (a cap of 0: one bucket per parameter). `first_bucket_cap_bytes` caps the first bucket of
    each dtype and device instead (DDP's 1 MiB when `bucket_cap_mb` is left at its default). Buckets come in
    the order they closed, then those left open.
    """
    if bucket_cap_bytes < 0 or (first_bucket_cap_bytes is not None and first_bucket_cap_bytes < 0):
        raise ValueError(f"bucket caps cannot be negative, got {bucket_cap_bytes} and {first_bucket_cap_bytes}")
    first_cap = bucket_cap_bytes if first_bucket_cap_bytes is None else first_bucket_cap_bytes
    buckets: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], list[int]]] = {}  # (dtype, device) -> (indices, [bytes])
    closed_before: set[tuple] = set()  # kinds whose first bucket has closed: the ordinary cap applies
    for index, param in enumerate(params):
        kind = (param.dtype, param.device)
        indices, size = open_buckets.setdefault(kind, ([], [0]))
        indices.append(index)
        size[0] += param.numel() * param.element_size()
        if size[0] >= (bucket_cap_bytes if kind in closed_before else first_cap):
            buckets.append(indices)
            del open_buckets[kind]
            closed_before.add(kind)
    return buckets + [indices for indices, _ in open_buckets.values()]


class Bucket:
    """Parameters whose gradients travel together in one flat buffer and one all_reduce."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.handle = None

    def reset(self) -> None:
        self.ready.clear()
        self.handle = None


class BucketedDataParallel(nn.Module):
    """Wraps a model; gradients are averaged over ranks by async all_reduces launched during backward.

    Buckets are filled in reverse parameter order (roughly the order backward produces gradients) by torch DDP's
    rule (`assign_buckets`): a bucket closes once it holds `bucket_cap_mb` MiB or more. Call
    `finish_gradient_sync()` after backward (before the optimizer step).
    `timeline` collects (kind, start, end) intervals of this rank for plotting: 'backward' and 'allreduce'.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None, broadcast: bool = True):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.require_sync = True
        self.timeline: list[tuple[str, float, float]] = []
        if broadcast:
            broadcast_parameters(module, group=group)
        params = list(reversed([p for p in module.parameters() if p.requires_grad]))
        self.buckets = [Bucket([params[i] for i in indices])
                        for indices in assign_buckets(params, int(bucket_cap_mb * 2**20))]
        self._bucket_of = {}
        for bucket in self.buckets:
            for param in bucket.params:
                self._bucket_of[param] = bucket
                param.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication), e.g. for all but the last micro-batch."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return
        bucket = self._bucket_of[param]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            offset = 0
            for p in bucket.params:  # pack the bucket's gradients into its flat buffer
                bucket.buffer[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                offset += p.numel()
            bucket.buffer.div_(self.world_size)
            bucket.launched_at = time.monotonic()
            bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all_reduce and copy the averaged gradients back into .grad."""
        if not self.require_sync:
            return
        for bucket in self.buckets:
            if bucket.handle is None:
                missing = [p.shape for p in bucket.params if id(p) not in bucket.ready]
                raise RuntimeError(f"a gradient bucket never became ready (parameters without gradients: "
                                   f"{missing}); did backward run on every parameter?")
            bucket.handle.wait()
            self.timeline.append(("allreduce", bucket.launched_at, time.monotonic()))
            offset = 0
            for p in bucket.params:
                p.grad.copy_(bucket.buffer[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            bucket.reset()

"""torch DDP training on the corpus, as a training script does it: a DistributedSampler per rank, no_sync
gradient accumulation, per-rank metrics and logs. Run on every rank of a course_lib.runtime.launch job (or torchrun):

    from course_lib.runtime.launch import launch
    from course_lib.data_parallel.torch_ddp import ddp_train
    ranks = launch(ddp_train, 2, kwargs=dict(steps=20, data_dir="data"))   # per-rank records, indices, weights

Each rank logs to the `course` logger, which course_lib.runtime.launch writes to logs/rank_<r>/train.log.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from course_lib.core.data import load_tokens, prepare_tokens
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.data_parallel.ddp import BucketedDataParallel
from course_lib.runtime.env import get_dist_info
from course_lib.parity import flat_parameters, global_batches, seeded_gpt

log = logging.getLogger("course")


_DDP_ARGUMENTS = set(inspect.signature(DistributedDataParallel.__init__).parameters)


def apply_ddp(model: nn.Module, device: torch.device | None = None, group=None, impl: str = "torch") -> nn.Module:
    """Data parallelism over `group` (default: all ranks): torch DDP (impl="torch") on the model's device (one GPU
    per rank: device_ids; on the CPU: none), or the course's BucketedDataParallel (impl="scratch", from
    course_lib.data_parallel.ddp: call its finish_gradient_sync() after backward). Returns the wrapper to
    train through; `model` stays the plain module (its state dict, evaluation).

    No buffer sync before each forward: the model's only buffers are the rotary cos/sin tables, computed
    identically on every rank, so re-sending rank 0's copy before every forward (DDP's default) would be wasted
    traffic. torch 2.13 names that switch forward_sync_buffers (broadcast_buffers before it, now deprecated).
    """
    if impl == "scratch":
        return BucketedDataParallel(model, group=group)
    if impl != "torch":
        raise ValueError(f"impl must be 'torch' (DistributedDataParallel) or 'scratch' (BucketedDataParallel), "
                         f"got {impl!r}")
    device = device or next(model.parameters()).device
    no_forward_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGUMENTS
                       else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   process_group=group, **no_forward_sync)


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len tokens; item i is (i, window i as torch.long)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, num_windows: int | None = None):
        available = len(tokens) // seq_len
        if available < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len={seq_len}")
        self.tokens, self.seq_len = tokens, seq_len
        self.num_windows = available if num_windows is None else min(num_windows, available)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int):
        return i, self.tokens[i * self.seq_len:(i + 1) * self.seq_len].long()


def recording_allreduce_hook(state: dict, bucket):  # no annotations: DDP rejects the strings of __future__
    """A DDP communication hook: torch's default all-reduce (average over the group), which first notes the
    bucket's *local* gradient: state['local_sq_norm'] adds its squared norm, state['allreduces'] counts calls.
    Returns a torch.futures.Future holding the averaged bucket, as DDP requires."""
    state["local_sq_norm"] += bucket.buffer().double().pow(2).sum().item()
    state["allreduces"] += 1
    group = state.get("group") or dist.group.WORLD
    tensor = bucket.buffer().div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _epochs(loader: DataLoader, sampler: DistributedSampler):
    """(epoch, indices, windows) forever; set_epoch gives every epoch a new shuffle, the same on all ranks."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for indices, windows in loader:
            yield epoch, indices, windows
        epoch += 1


def ddp_train(steps: int = 30, micro_batch: int = 8, grad_accum_steps: int = 1, seq_len: int = 64,
              preset: str = "tiny", lr: float = 3e-3, seed: int = 0, data_dir: str = "data",
              num_windows: int | None = None, log_every: int = 10, rank_metric=None,
              fault=None) -> dict:
    """torch DDP training on the corpus, each rank reading its shard through a DistributedSampler.

    Every step accumulates grad_accum_steps micro-batches under no_sync (one gradient all-reduce per step).
    Per step and rank it records the local loss, the norm of this rank's own gradient before averaging (via a
    communication hook), the norm of the averaged gradient, tokens seen and the step time; and the dataset
    indices read. rank_metric(model, windows, info) -> dict adds your own columns; it is called after the
    gradients are averaged and clipped, before the optimizer step, and must live in a module.
    fault(rank, step): called by every rank at the start of every step, to see how a job fails (it may raise, or
    kill its own process); like rank_metric it must live in a module (spawnable makes a notebook's importable).
    """
    info = get_dist_info()
    if info.rank == 0:
        prepare_tokens(data_dir, progress=False)
    dist.barrier()  # the others read the token files only once rank 0 has written them
    dataset = TokenWindows(load_tokens("train", data_dir), seq_len, num_windows)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)  # rank, world size: the group's
    batches = _epochs(DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True), sampler)
    model = seeded_gpt(seed, preset, block_size=seq_len).to(info.device)
    ddp = apply_ddp(model, info.device)
    hook_state = {"local_sq_norm": 0.0, "allreduces": 0}
    ddp.register_comm_hook(hook_state, recording_allreduce_hook)
    optimizer = configure_optimizer(model, lr)
    records, indices_read, tokens_seen = [], [], 0
    for step in range(steps):
        if fault is not None:
            fault(info.rank, step)
        hook_state.update(local_sq_norm=0.0, allreduces=0)
        start = time.perf_counter()
        windows_read = []
        for _ in range(grad_accum_steps):
            epoch, indices, windows = next(batches)
            indices_read.append((step, epoch, indices.tolist()))
            windows_read.append(windows.to(info.device))
        extra = {}
        # The micro-batches accumulate under no_sync (one all-reduce per step); the clipped norm is of the averaged
        # gradient, the same on all ranks; rank_metric sees the gradients the optimizer is about to use.
        stats = train_step(ddp, windows_read, optimizer, grad_clip=1.0, no_sync=ddp.no_sync,
                           before_step=(lambda: extra.update(rank_metric(model, windows_read, info)))
                           if rank_metric is not None else None)
        grad_norm = stats["grad_norm"]
        tokens_seen += grad_accum_steps * micro_batch * seq_len
        records.append({"step": step, "epoch": epoch, "loss": stats["loss"],
                        "local_grad_norm": math.sqrt(hook_state["local_sq_norm"]), "grad_norm": grad_norm,
                        "tokens_seen": tokens_seen, "allreduces": hook_state["allreduces"],
                        "step_s": time.perf_counter() - start, **extra})
        if log_every and (step % log_every == 0 or step == steps - 1):
            log.info("step %d loss %.4f local grad norm %.3f synced grad norm %.3f tokens seen %d", step,
                     records[-1]["loss"], records[-1]["local_grad_norm"], grad_norm, tokens_seen)
    return {"rank": info.rank, "records": records, "indices": indices_read, "dataset_size": len(dataset),
            "samples_per_epoch": len(sampler), "threads": torch.get_num_threads(),
            "params": flat_parameters(model)}


def no_sync_accumulation(micro_batch: int = 2, grad_accum_steps: int = 4, seq_len: int = 32,
                         preset: str = "tiny", seed: int = 0) -> dict:
    """Gradients of one accumulated step under torch DDP, with no_sync and with a sync after every micro-batch.

    Rank r's micro-batch i is rows (i * world_size + r) * micro_batch ... of
    global_batches(1, micro_batch * grad_accum_steps * world_size, seq_len, seed)[0], so the whole step covers
    that global batch once: both variants must equal one process's gradient on it.
    """
    info = get_dist_info()
    rank, world_size = info.rank, info.world_size
    batch = global_batches(1, micro_batch * grad_accum_steps * world_size, seq_len, seed)[0].to(info.device)
    out = {}
    for variant in ("no_sync", "sync_every_micro_batch"):
        model = seeded_gpt(seed, preset, block_size=seq_len).to(info.device)
        ddp = apply_ddp(model, info.device)
        state = {"local_sq_norm": 0.0, "allreduces": 0}
        ddp.register_comm_hook(state, recording_allreduce_hook)
        for i in range(grad_accum_steps):
            first = (i * world_size + rank) * micro_batch
            rows = batch[first:first + micro_batch]
            skip_sync = variant == "no_sync" and i < grad_accum_steps - 1
            with ddp.no_sync() if skip_sync else nullcontext():
                _, loss = ddp(rows, targets=rows)
                (loss / grad_accum_steps).backward()
        out[variant] = {"grads": {n: p.grad.cpu() for n, p in model.named_parameters()},
                        "allreduces": state["allreduces"]}
    return out


def train_and_accumulate(train_kwargs: dict | None = None, accumulation_kwargs: dict | None = None) -> dict:
    """ddp_train(**train_kwargs), then no_sync_accumulation(**accumulation_kwargs), in one job (one start-up)."""
    return {"train": ddp_train(**(train_kwargs or {})),
            "accumulation": no_sync_accumulation(**(accumulation_kwargs or {}))}

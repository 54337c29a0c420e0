"""Rank workers of the debugging lab (Session C, notebook 06): six faulty programs and the checks of their fixes.

Each `buggy_*` function is a program with one classic distributed bug, run by the lab to show the error or
the silent wrong result it gives on a cluster; each `check_*` worker runs the learner's fixed version on
every rank and returns what the test cell compares with one process.

    ranks = launch(check_mean_loss, 3, args=(spawnable(mean_loss),))
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from course_lib.runtime.env import get_dist_info
from course_lib.testing import global_batches, gradients, local_rows, seeded_gpt

# ---------------------------------------------------------------------------------------------- 1. a hang


def buggy_mean_loss(loss: float) -> float | None:
    """Bug: only rank 0 joins the all-reduce (it is the one that prints), so rank 0 waits forever."""
    if dist.get_rank() == 0:
        total = torch.tensor([loss], dtype=torch.float64, device=get_dist_info().device)
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()
    return None


def rank_loss(rank: int) -> float:
    return 2.0 + 0.5 * rank ** 2


def check_mean_loss(mean_fn) -> dict:
    """Worker: mean_fn(this rank's loss) on every rank, twice (a second call shows leftover mismatches)."""
    rank = dist.get_rank()
    return {"rank": rank, "results": [mean_fn(rank_loss(rank)), mean_fn(rank_loss(rank) + 1.0)]}


# ---------------------------------------------------------------------------------------------- 2. the sampler


def buggy_epoch_indices(num_samples: int, rank: int, world_size: int, epoch: int, seed: int = 0) -> list[int]:
    """Bug: the sampler is never told the epoch, so every epoch visits the samples in the same order."""
    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return list(sampler)


def check_epoch_indices(indices_fn, *, num_samples: int = 10, epochs: int = 3, seed: int = 0) -> dict:
    """Worker: this rank's indices for each epoch, from indices_fn."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return {"rank": rank, "epochs": [list(indices_fn(num_samples, rank, world_size, epoch, seed))
                                     for epoch in range(epochs)]}


def epoch_indices_reference(num_samples: int, world_size: int, epochs: int, seed: int = 0) -> list[list[list[int]]]:
    """[epoch][rank] -> DistributedSampler's indices after set_epoch(epoch)."""
    out = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(world_size):
            sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        out.append(per_rank)
    return out


# ---------------------------------------------------------------------------------------------- 3. unused parameter


class TwoHeads(nn.Module):
    """A trunk and two heads; this task uses head "a" only, so head "b" gets no gradient."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 2)

    def forward(self, x):
        return self.head_a(torch.relu(self.trunk(x)))


def two_heads(seed: int = 0) -> TwoHeads:
    torch.manual_seed(seed)
    return TwoHeads()


def head_batches(steps: int, global_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 3)
    return [(torch.randn(global_batch, 6, generator=generator), torch.randn(global_batch, 3, generator=generator))
            for _ in range(steps)]


def buggy_wrap(model: nn.Module) -> nn.Module:
    """Bug: plain DDP expects a gradient for every parameter; head_b never gets one, so step 2 fails."""
    return DistributedDataParallel(model)


def check_unused_parameter(wrap_fn, *, steps: int = 3, rows_per_rank: int = 2, seed: int = 0) -> dict:
    """Worker: model = wrap_fn(TwoHeads()), then `steps` SGD steps on this rank's rows; final parameters."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = two_heads(seed)
    wrapped = wrap_fn(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for x, y in head_batches(steps, rows_per_rank * world_size, seed):
        optimizer.zero_grad(set_to_none=True)
        rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        nn.functional.mse_loss(wrapped(x[rows]), y[rows]).backward()
        optimizer.step()
    return {"rank": rank, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "is_ddp": isinstance(wrapped, DistributedDataParallel)}


def unused_parameter_reference(world_size: int, *, steps: int = 3, rows_per_rank: int = 2, seed: int = 0) -> dict:
    model = two_heads(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in head_batches(steps, rows_per_rank * world_size, seed):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------- 4. accumulation


def buggy_accumulate(model, micro_batches) -> None:
    """Bug: each micro-batch's loss is a mean, and the gradients of K of them add up: K times too large."""
    for idx in micro_batches:
        _, loss = model(idx, targets=idx)
        loss.backward()


def check_accumulation(accumulate_fn, *, micro_batches: int = 3, rows: int = 1, seq_len: int = 16,
                       seed: int = 0) -> dict:
    """Worker: DDP over the tiny GPT, accumulate_fn(ddp, this rank's micro-batches); the gradients it leaves."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = seeded_gpt(seed, "tiny")
    ddp = DistributedDataParallel(model)
    batches = global_batches(micro_batches, rows * world_size, seq_len, seed)
    accumulate_fn(ddp, [local_rows(b, rank, world_size) for b in batches])
    return {"rank": rank, "grads": gradients(model)}


def accumulation_reference(world_size: int, *, micro_batches: int = 3, rows: int = 1, seq_len: int = 16,
                           seed: int = 0) -> dict:
    """One process: the gradient of the mean loss over every micro-batch of every rank."""
    model = seeded_gpt(seed, "tiny")
    batches = global_batches(micro_batches, rows * world_size, seq_len, seed)
    for batch in batches:
        (model(batch, targets=batch)[1] / len(batches)).backward()
    return gradients(model)


# ---------------------------------------------------------------------------------------------- 5. fp16


TINY_LOSS_SCALE = 1e-9
"""The lab's loss is this small (a well-trained model's gradients get this small): in fp16 they flush to 0."""


def fp16_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def fp16_batches(steps: int, rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed + 7)
    return [(torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)) for _ in range(steps)]


def tiny_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return TINY_LOSS_SCALE * nn.functional.mse_loss(output.float(), target)


def buggy_fp16_step(model, optimizer, scaler, x, y) -> None:
    """Bug: fp16 autocast without loss scaling: gradients below 6e-8 become 0 and the step does nothing."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = tiny_loss(model(x), y)
    loss.backward()
    optimizer.step()


OVERFLOW = 1e5
"""Inputs multiplied by this overflow fp16 (largest finite value 65,504) in the first layer's output."""


def check_fp16(step_fn, *, steps: int = 3, rows_per_rank: int = 4, overflow_step: int | None = None,
               seed: int = 0) -> dict:
    """Worker: DDP over a small MLP, `steps` of step_fn(ddp, SGD, GradScaler, x, y) on this rank's rows.

    overflow_step: that step's inputs are multiplied by OVERFLOW on every rank: fp16 overflows to inf, and a
    correct step is skipped (GradScaler finds the inf) instead of writing NaN into the weights.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = fp16_model(seed)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e6)  # the tiny loss's gradients need a large step
    scaler = torch.amp.GradScaler("cpu")
    for step, (x, y) in enumerate(fp16_batches(steps, rows_per_rank * world_size, seed)):
        rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        x = x * OVERFLOW if step == overflow_step else x
        step_fn(ddp, optimizer, scaler, x[rows], y[rows])
    return {"rank": rank, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "scale": scaler.get_scale() if scaler.is_enabled() else None}


def fp16_reference(world_size: int, *, steps: int = 3, rows_per_rank: int = 4, overflow_step: int | None = None,
                   seed: int = 0) -> dict:
    """One process in fp32, the overflow step skipped: the parameters the fixed fp16 run approaches."""
    model = fp16_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e6)
    for step, (x, y) in enumerate(fp16_batches(steps, rows_per_rank * world_size, seed)):
        if step == overflow_step:
            continue
        optimizer.zero_grad(set_to_none=True)
        tiny_loss(model(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------- 6. checkpoint


def buggy_save(model: nn.Module, path: str) -> None:
    """Bug: every rank writes the same file at once, in place: a reader can see a half-written file."""
    torch.save(model.state_dict(), path)


def check_checkpoint_writers(save_fn, directory: str, *, seed: int = 0) -> dict:
    """Worker: save_fn(model, path) on every rank, then every rank loads the file at once."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = nn.Linear(32, 32)
    path = str(Path(directory) / "model.pt")
    writes, renames = [], []
    real_save, real_replace = torch.save, os.replace

    def recording_save(obj, f, *args, **kwargs):
        writes.append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else "<file object>")
        return real_save(obj, f, *args, **kwargs)

    def recording_replace(src, dst, *args, **kwargs):
        renames.append((os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    with mock.patch.object(torch, "save", recording_save), mock.patch.object(os, "replace", recording_replace):
        save_fn(model, path)
    try:  # right after save_fn returns, on every rank: the checkpoint must be there, whole
        loaded = torch.load(path, weights_only=True)
        restored = all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
        error = None
    except Exception as err:  # noqa: BLE001 (reported to the test cell)
        restored, error = False, f"{type(err).__name__}: {err}"
    dist.barrier()
    return {"rank": rank, "writes": writes, "renames": renames, "restored": restored, "error": error}

"""One optimizer step and one evaluation: the pieces every training strategy shares.

`train_step` works on a plain model, on a data-parallel wrapper (pass its `no_sync` so only the last
micro-batch's backward communicates) and on any layout's course_lib.parallel.Parallelized, which runs the
forward and backward (a pipeline schedule, gradient averaging) and the global gradient norm its own way.
`evaluate` can split its batches over ranks.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from course_lib.core.data import eval_batches
from course_lib.core.device import autocast_context


def accumulate_gradients(model, micro_batches, *, amp_dtype=None, scaler=None, no_sync=None) -> torch.Tensor:
    """Forward + backward over the micro-batches, adding up .grad; returns the mean loss (detached).

    Each loss is divided by the number of micro-batches, so the summed gradient equals the gradient of
    the mean loss over the whole batch. `no_sync` (e.g. DDP's model.no_sync) wraps all but the last
    backward, so a data-parallel wrapper communicates once per step.
    """
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0].device)
    for i, idx in enumerate(micro_batches):
        with no_sync() if no_sync is not None and i < n - 1 else nullcontext():
            with autocast_context(idx.device, amp_dtype):
                _, loss = model(idx, targets=idx)
            scaled = loss / n
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach().float()
    return loss_sum / n


def clip_gradients(parameters, max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (None/0: no clipping); returns the norm before."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm else float("inf"))


def train_step(model, micro_batches, optimizer, scheduler=None, *, scaler=None, grad_clip=None, amp_dtype=None,
               no_sync=None, forward_backward=None, after_backward=None, before_step=None,
               grad_norm: bool = True, zero_grad: bool = True) -> dict:
    """One optimizer step: accumulate, (unscale,) clip, step, advance the schedule, zero the grads.

    The one optimizer step of the course: every loop (course_lib.train, the rank workers, the notebooks) calls it.
    What a worker adds to a step goes in through two doors:
      forward_backward(micro_batches) -> loss   computes the gradients its own way (timed phase by phase, through
                                                a hand-written synchronisation, ...) instead of accumulate_gradients;
      after_backward()                          runs once the gradients are complete, before clipping (finish a
                                                bucketed all-reduce, copy the first step's gradients, ...);
      before_step()                             runs after clipping, right before the update (read the gradients
                                                the optimizer is about to use).
    grad_norm=False skips the norm (and the collectives a sharded model's norm needs) when nothing clips;
    zero_grad=False keeps the gradients after the update, for a caller that measures the memory they hold.

    Returns {"loss": mean micro-batch loss, "grad_norm": norm before clipping (None if skipped), "lr": lr used}.
    """
    lr = optimizer.param_groups[0]["lr"]
    parallel = hasattr(model, "forward_backward")  # a course_lib.parallel.Parallelized: its layout does the work
    if forward_backward is not None:
        loss = forward_backward(micro_batches)
    elif parallel:
        loss = model.forward_backward(micro_batches, amp_dtype=amp_dtype, scaler=scaler)
    else:
        loss = accumulate_gradients(model, micro_batches, amp_dtype=amp_dtype, scaler=scaler, no_sync=no_sync)
    if after_backward is not None:
        after_backward()
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip true gradients, not scaled ones
    if not grad_norm and not grad_clip:
        norm = None
    else:
        norm = model.clip_grad_norm(grad_clip) if parallel else clip_gradients(model.parameters(), grad_clip)
    if before_step is not None:
        before_step()
    if scaler is not None:
        scaler.step(optimizer)  # skips the step if the unscaled gradients hold inf/NaN
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    if isinstance(loss, torch.Tensor):
        loss = loss.item()  # a worker's forward_backward may hand back the loss it called backward on
    return {"loss": loss,  # None: a pipeline stage that holds no loss
            "grad_norm": None if norm is None else norm.item(), "lr": lr}


@torch.no_grad()
def evaluate(model, tokens, *, batch_size: int, block_size: int, max_batches: int | None, amp_dtype=None,
             rank: int = 0, world_size: int = 1, group=None) -> float:
    """Mean loss over the first max_batches deterministic validation batches (eval mode, no grad).

    With world_size > 1 each rank evaluates every world_size-th batch and the sums are all-reduced, so every
    rank returns the same value as one process evaluating all batches (`group`: the ranks that split them,
    default all). Pass the unwrapped model.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, rows = 0.0, 0
    for i, idx in enumerate(eval_batches(tokens, batch_size, block_size, max_batches)):
        if i % world_size != rank:
            continue
        idx = idx.to(device)
        with autocast_context(device, amp_dtype):
            _, loss = model(idx, targets=idx)
        total += loss.item() * idx.size(0)  # the last batch may be short: weight by rows
        rows += idx.size(0)
    model.train(was_training)
    if world_size > 1:
        sums = torch.tensor([total, rows], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        total, rows = sums.tolist()
    return total / rows

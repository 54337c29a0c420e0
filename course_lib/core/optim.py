"""AdamW with two parameter groups, and the learning-rate schedule: linear warmup, then cosine decay.

Weight decay pulls weights towards zero. It is meant for the matrices that mix features (linear layers,
embeddings); applied to RMSNorm gains or biases it only fights the scale they are there to learn. So
parameters with two or more dimensions are decayed and 1-D parameters are not (the nanoGPT rule).

    python -m course_lib.core.optim     # prints the groups of the tiny model and a few schedule values
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from course_lib.core.model import GPT, GPTConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[{params: >=2-D, weight_decay}, {params: 1-D, weight_decay: 0}], each trainable parameter once.

    `named_parameters()` yields a shared (tied) tensor only once, so the tied embedding / lm_head matrix
    is counted, decayed and updated once.
    """
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def configure_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                        fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over `param_groups(model, weight_decay)`. fused=None lets torch pick its default kernel."""
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    groups = param_groups(model, weight_decay)
    if not groups[0]["params"] and not groups[1]["params"]:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    kwargs = {} if fused is None else {"fused": fused}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kwargs)


def get_lr(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the first update uses step 0).

    - warmup, 0 <= step < warmup_steps: max_lr * (step + 1) / warmup_steps, a straight line that starts at
      max_lr / warmup_steps (never 0, so the first step already moves) and reaches max_lr at warmup_steps - 1;
    - decay, warmup_steps <= step < max_steps: half a cosine from max_lr (at warmup_steps) to min_lr
      (at max_steps): min_lr + 0.5 * (1 + cos(pi * progress)) * (max_lr - min_lr),
      progress = (step - warmup_steps) / (max_steps - warmup_steps);
    - step >= max_steps: min_lr.
    """
    if not 0 <= warmup_steps <= max_steps:
        raise ValueError(f"need 0 <= warmup_steps <= max_steps, got warmup_steps={warmup_steps}, max_steps={max_steps}")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def _lr_factor(step: int, *, max_lr: float, **schedule) -> float:
    return get_lr(step, max_lr=max_lr, **schedule) / max_lr


def make_scheduler(optimizer: torch.optim.Optimizer, *, max_lr: float, min_lr: float, warmup_steps: int,
                   max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that sets every group's lr to get_lr(step) (the groups' base lr must be max_lr).

    A scheduler object (not a bare function) so its position is part of a checkpoint's state. Call
    `scheduler.step()` once after every `optimizer.step()`.
    """
    for group in optimizer.param_groups:
        base = group.get("initial_lr", group["lr"])
        if not math.isclose(base, max_lr):
            raise ValueError(f"optimizer lr {base} differs from the schedule's max_lr {max_lr}; build both from one lr")
    get_lr(0, max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup_steps, max_steps=max_steps)  # validates
    factor = functools.partial(_lr_factor, max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup_steps,
                               max_steps=max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def main():
    model = GPT(GPTConfig.from_preset("tiny"))
    decay, no_decay = param_groups(model, 0.1)
    print(f"decayed: {len(decay['params'])} tensors, {sum(p.numel() for p in decay['params']):,} parameters")
    print(f"not decayed: {len(no_decay['params'])} tensors, {sum(p.numel() for p in no_decay['params']):,} parameters")
    schedule = dict(max_lr=3e-3, min_lr=3e-4, warmup_steps=20, max_steps=200)
    for step in (0, 19, 20, 110, 200, 250):
        print(f"get_lr({step:3d}) = {get_lr(step, **schedule):.6f}")


if __name__ == "__main__":
    main()

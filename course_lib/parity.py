"""What every parity check shares: the same model, the same batches and the one-process reference, written once.

A parallel run is right when it reproduces one process that holds the whole model and sees each whole global
batch. The rank workers, the tests and the benchmarks all build that comparison from these pieces:

- `seeded_gpt`: the same initial weights wherever it is called with the same seed (every rank, the reference).
- `global_batches`: the same seeded sequence of global batches of token ids on every rank.
- `local_rows`: this rank's contiguous rows of a global batch.
- `train_whole_batches`: one process trains on each whole batch; first-step gradients, losses, final parameters.
- `single_process_run`: that reference for the data-parallel runs (plain AdamW on the tiny preset).
- `gradients`, `flat_parameters`: copies to compare (each parameter's .grad; all parameters in one vector).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.core.model import GPT, GPTConfig
from course_lib.core.steps import train_step


def seeded_gpt(seed: int = 0, preset: str = "tiny", config: GPTConfig | None = None, **overrides) -> GPT:
    """GPT(config, or the preset with `overrides`) with weights drawn after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return GPT(config if config is not None else GPTConfig.from_preset(preset, **overrides))


def global_batches(steps: int, global_batch: int, seq_len: int, seed: int, vocab_size: int = 256):
    """The same `steps` batches of (global_batch, seq_len) token ids on every rank; each rank takes its rows."""
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab_size, (global_batch, seq_len), generator=generator) for _ in range(steps)]


def local_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows [rank * n, (rank + 1) * n) of a global batch of world_size * n rows: this rank's share."""
    if batch.shape[0] % world_size:
        raise ValueError(f"a global batch of {batch.shape[0]} rows does not split over world_size={world_size} "
                         "ranks: make the global batch a multiple of the world size")
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows]


def train_whole_batches(model: nn.Module, optimizer, batches, *, grad_clip: float | None = None) -> dict:
    """One process, the whole model, each whole batch: {"grads": first-step gradients, "losses", "params"}.

    grad_clip: clip the global gradient norm before each step (None: no clipping): core.steps.train_step's step.
    """
    first, losses = [], []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        keep_first = (lambda: first.append(gradients(model))) if not first else None
        losses.append(train_step(model, [batch], optimizer, grad_clip=grad_clip, after_backward=keep_first,
                                 grad_norm=False, zero_grad=False)["loss"])  # the last step's gradients stay
    return {"grads": first[0] if first else None, "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def single_process_run(steps: int = 3, preset: str = "tiny", global_batch: int = 8, seq_len: int = 32,
                       seed: int = 0) -> dict:
    """The reference of the data-parallel runs: plain AdamW (lr 1e-3, weight decay 0.1 on every parameter)."""
    model = seeded_gpt(seed, preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return train_whole_batches(model, optimizer, global_batches(steps, global_batch, seq_len, seed))


def gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """name -> a copy of the parameter's .grad (None where it has none: frozen or unused)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All parameters in one CPU vector (to compare replicas)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()

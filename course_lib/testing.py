"""Helpers shared by the rank workers, the tests and the benchmarks: the same inputs everywhere, compared the same way.

A parity check needs the same model, the same global batches and the same comparison on every rank and in the
one-process reference; each of those lives here once.

- `global_batches`: the same seeded sequence of global batches on every rank (each rank then takes its rows).
- `flat_parameters`: all parameters in one CPU vector, to compare replicas.
- `seeded_model_and_optimizer`, `single_process_run`: the one-process reference a data-parallel run must equal.
"""

from __future__ import annotations

import torch

from course_lib.core.model import GPT, GPTConfig


def global_batches(steps: int, global_batch: int, seq_len: int, seed: int, vocab_size: int = 256):
    """The same sequence of global batches on every rank; each rank then takes its own rows."""
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab_size, (global_batch, seq_len), generator=generator) for _ in range(steps)]


def flat_parameters(model) -> torch.Tensor:
    """All parameters in one CPU vector (to compare replicas in the notebook)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def seeded_model_and_optimizer(preset: str = "tiny", seed: int = 0):
    """The same GPT on every rank and in the reference (seeded), with the plain AdamW the parity runs use."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset(preset))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, optimizer


def single_process_run(steps: int = 3, preset: str = "tiny", global_batch: int = 8, seq_len: int = 32,
                       seed: int = 0) -> dict:
    """The reference: one process, the whole global batch each step."""
    model, optimizer = seeded_model_and_optimizer(preset, seed)
    first_grads, losses = None, []
    for batch in global_batches(steps, global_batch, seq_len, seed):
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(batch, targets=batch)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return {"grads": first_grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": losses}

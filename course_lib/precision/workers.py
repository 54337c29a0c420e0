"""Rank workers for mixed precision under data parallelism: one rank's fp16 overflow, and what GradScaler does.

    launch(amp_ddp_overflow, 2)      # every rank skips the same step and backs off the same scale
"""

from __future__ import annotations

import logging

import torch

from course_lib.core.steps import train_step
from course_lib.data_parallel.torch_ddp import apply_ddp
from course_lib.runtime.env import get_dist_info
from course_lib.parity import flat_parameters, seeded_gpt

log = logging.getLogger("course")  # course_lib.runtime.launch sends it to logs/rank_<r>/train.log


def amp_ddp_overflow(steps: int = 8, overflow_rank: int = 1, overflow_step: int = 3, init_scale: float = 2.0**10,
                     growth_interval: int = 3, local_batch: int = 4, seq_len: int = 32, seed: int = 0) -> dict:
    """fp16 autocast + GradScaler under torch DDP; one rank's gradients overflow at one step.

    The all-reduce spreads that rank's inf to every rank's averaged gradient, so every rank's GradScaler skips
    the same step and halves its scale: the replicas stay identical. Returns per-step records and final params.
    """
    info = get_dist_info()
    rank, device = info.rank, info.device
    model = seeded_gpt(seed, "tiny", block_size=seq_len).to(device)
    ddp = apply_ddp(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    records = []
    def forward_backward(micro_batches, injected: bool):
        (rows,) = micro_batches
        with torch.autocast(device.type, dtype=torch.float16):
            _, loss = ddp(rows, targets=rows)
        scaled = scaler.scale(loss)
        if injected:
            scaled = scaled * 1e38  # a spike: this rank's gradients become inf
        scaled.backward()  # DDP averages the (scaled) gradients here, inf included
        return loss.detach()

    for step in range(steps):
        rows = torch.randint(0, 256, (local_batch, seq_len), generator=generator).to(device)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        injected = rank == overflow_rank and step == overflow_step
        stats = train_step(ddp, [rows], optimizer, scaler=scaler, grad_norm=False,
                           forward_backward=lambda micro_batches: forward_backward(micro_batches, injected))
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        records.append({"step": step, "scale": scale, "skipped": skipped, "injected_here": injected,
                        "loss": stats["loss"]})
    return {"rank": rank, "records": records,
            "params": flat_parameters(model)}

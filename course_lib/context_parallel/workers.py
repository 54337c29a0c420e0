"""Rank workers for context parallelism: ring attention on every rank against full attention in one process.

    from course_lib import launch
    from course_lib.context_parallel import full_attention_reference, ring_attention_run
    ranks = launch(ring_attention_run, 4, kwargs={"layout": "zigzag"})     # one dict per rank
    reference = full_attention_reference()                                  # the same inputs, one process

Every rank builds the same full inputs from the seed (attention_inputs), keeps its rows of the sequence,
runs ring_attention forward and backward (with the same upstream gradient's rows) and returns its rows of
the output and of the gradients, with what it sent and computed (RingStats).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.context_parallel.ring import RingStats, ring_attention, split_sequence

SHAPE = {"batch": 2, "heads": 2, "seq_len": 32, "head_dim": 8}


def attention_inputs(*, batch: int = 2, heads: int = 2, seq_len: int = 32, head_dim: int = 8, dtype=torch.float32,
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v and an upstream gradient, (batch, heads, seq_len, head_dim), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq_len, head_dim)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name in ("q", "k", "v", "grad_out")}


def full_attention_reference(*, dtype=torch.float32, seed: int = 0, **shape) -> dict[str, torch.Tensor]:
    """Causal attention over the whole sequence in one process (torch's scaled_dot_product_attention, in fp32):
    the output and the gradients of q, k, v."""
    inputs = attention_inputs(dtype=dtype, seed=seed, **shape)
    q, k, v = (inputs[name].float().requires_grad_() for name in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(inputs["grad_out"].float())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def ring_attention_run(*, layout: str = "contiguous", dtype=torch.float32, seed: int = 0, **shape) -> dict:
    """Worker: this rank's rows of the output and of dq, dk, dv by ring attention, and its RingStats."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs = attention_inputs(dtype=dtype, seed=seed, **shape)
    local = {name: split_sequence(t, rank, world_size, layout).clone() for name, t in inputs.items()}
    q, k, v = (local[name].requires_grad_() for name in ("q", "k", "v"))
    stats = RingStats()
    out = ring_attention(q, k, v, layout=layout, stats=stats)
    out.backward(local["grad_out"])
    return {"rank": rank, "world_size": world_size, "layout": layout, "out": out.detach(), "dq": q.grad,
            "dk": k.grad, "dv": v.grad, "sent_elements": dict(stats.sent_elements), "pairs": dict(stats.pairs),
            "blocks": dict(stats.blocks), "kv_elements": k.numel() + v.numel()}

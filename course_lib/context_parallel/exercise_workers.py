"""Rank workers that grade the context-parallel exercises (Session F, notebook 01b): the learner's ring attention
on real ranks, against full causal attention in one process.

    ranks = launch(check_ring_attention, 2, args=(spawnable(ring_attention),), kwargs=dict(layout="zigzag"))
    reference = full_attention_reference(seq_len=16)

Each rank builds the same full q, k, v and upstream gradient from the seed, keeps its rows of the sequence (the
layout's split), and calls `ring_attention(q, k, v, positions_of, merge)`: `positions_of(r)` gives the sequence
positions of rank r's rows, `merge` is course_lib's online-softmax merge (so that a mistake in the merge exercise
costs only that exercise). The worker measures what the answer did: every point-to-point message of the forward
and of the backward (course_lib.pipeline_parallel.p2p_record), every collective it called, and the floating-point
operations of its forward (torch.utils.flop_counter), the work that zigzag balances.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from course_lib.context_parallel.ring import merge, positions, split_sequence
from course_lib.context_parallel.workers import attention_inputs
from course_lib.pipeline_parallel.p2p_record import record_p2p

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_to_all", "all_to_all_single",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_gather_object")


def merge_with_lse(out_a, lse_a, out_b, lse_b):
    """course_lib's merge, as the exercise names its arguments: (out, lse) of the attention over both key sets."""
    return merge(out_a, lse_a, out_b, lse_b)


def check_ring_attention(ring_attention, *, layout: str = "contiguous", dtype: str = "float32", seed: int = 0,
                         batch: int = 2, heads: int = 2, rows_per_rank: int = 8, head_dim: int = 8) -> dict:
    """Worker: this rank's rows of the output and of dq, dk, dv from `ring_attention`, with the messages of its
    forward and backward ((peer, tag, bytes) each), the collectives it called and the flops of its forward."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    inputs = attention_inputs(batch=batch, heads=heads, seq_len=rows_per_rank * world_size, head_dim=head_dim,
                              dtype=DTYPES[dtype], seed=seed)
    local = {name: split_sequence(t, rank, world_size, layout).clone() for name, t in inputs.items()}
    q, k, v = (local[name].requires_grad_() for name in ("q", "k", "v"))
    table = {r: positions(r, world_size, rows_per_rank, layout) for r in range(world_size)}

    def positions_of(r: int) -> torch.Tensor:
        if not 0 <= int(r) < world_size:
            raise ValueError(f"positions_of({r}): ranks are 0..{world_size - 1}")
        return table[int(r)].clone()

    called = []

    def counting(name):
        original = getattr(dist, name)

        def call(*args, **kwargs):
            called.append(name)
            return original(*args, **kwargs)
        return call

    with mock.patch.multiple(dist, **{name: counting(name) for name in COLLECTIVES if hasattr(dist, name)}):
        with record_p2p() as forward, FlopCounterMode(display=False) as flops:
            out = ring_attention(q, k, v, positions_of, merge_with_lse)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            raise TypeError(f"ring_attention must return this rank's output, a tensor of q's shape {tuple(q.shape)}; "
                            f"got {type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        if not out.requires_grad:
            raise TypeError("the output does not require grad: backward cannot reach q, k and v (wrap the ring in a "
                            "torch.autograd.Function, or keep the computation differentiable)")
        with record_p2p() as backward:
            out.backward(local["grad_out"])
    dist.barrier()
    grads = {name: (t.grad.detach().float() if t.grad is not None else None) for name, t in (("dq", q), ("dk", k),
                                                                                            ("dv", v))}
    return {"rank": rank, "world_size": world_size, "layout": layout, "dtype": dtype, "out": out.detach().float(),
            **grads, "sent_forward": forward.sent, "sent_backward": backward.sent, "received_forward": forward.received,
            "collectives": called, "forward_flops": flops.get_total_flops(),
            "kv_bytes": k.numel() * k.element_size() + v.numel() * v.element_size(), "positions": table[rank].tolist()}

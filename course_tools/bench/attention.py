"""Attention section of `make bench`: fused SDPA against softmax(QK^T) written out, time and saved memory.

    .venv/bin/python scripts/bench.py --only attention
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.core.model import causal_attention
from course_lib.memory.activations import count_saved_bytes
from course_lib.observability.timing import time_alternating
from course_tools.bench.report import Column, Options, Table

ATTENTION_SHAPE = {"batch": 4, "heads": 12, "head_dim": 64}
"""GPT-2-small's heads (12 x 64); batch 4 keeps the explicit path's T=512 scores at 50 MB."""


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def saved_bytes(fn, *inputs) -> int:
    """Bytes autograd saves for backward when running fn(*inputs), each storage once, inputs excluded."""
    with count_saved_bytes(exclude=inputs) as counter:
        fn(*inputs)
    return counter["bytes"]


def run_attention(opts: Options) -> Table:
    """Fused SDPA against softmax(QK^T) written out, at T=128 and T=512.

    The explicit path materialises a (T, T) score matrix per head (and its masked copy and softmax), so
    its memory traffic grows with T^2; SDPA's CPU flash kernel works on tiles that stay in cache and saves
    only a (T,) log-sum-exp per row for backward.
    """
    B, H, Q = ATTENTION_SHAPE["batch"], ATTENTION_SHAPE["heads"], ATTENTION_SHAPE["head_dim"]
    rows = []
    for T in (128, 512):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, T, Q, generator=g, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(B, H, T, Q, generator=g)
        impls = {"sdpa": sdpa, "explicit": causal_attention}

        def forward(fn):
            def run():
                with torch.no_grad():
                    fn(q, k, v)
            return run

        def forward_backward(fn):
            def run():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad_out)
            return run

        scores_mb = B * H * T * T * 4 / 1e6
        saved = {name: saved_bytes(fn, q, k, v) / 1e6 for name, fn in impls.items()}
        for pass_name, wrap in (("forward", forward), ("forward+backward", forward_backward)):
            t = time_alternating({name: wrap(fn) for name, fn in impls.items()},
                                 warmup=2, rounds=3 if opts.quick else 15)
            row = {"seq_len": T, "pass": pass_name, "sdpa_ms": t["sdpa"].median * 1e3,
                   "explicit_ms": t["explicit"].median * 1e3,
                   "speedup": t["explicit"].median / t["sdpa"].median, "scores_mb": scores_mb}
            if pass_name == "forward+backward":
                row.update(saved_explicit_mb=saved["explicit"], saved_sdpa_mb=saved["sdpa"])
            rows.append(row)
    return Table(
        title=f"Causal attention, B={B}, heads={H}, head_dim={Q}, fp32: SDPA vs explicit softmax(QK^T/sqrt(d))V",
        columns=[Column("seq_len", "T"), Column("pass", "pass"), Column("sdpa_ms", "SDPA ms", "{:.2f}"),
                 Column("explicit_ms", "explicit ms", "{:.2f}"), Column("speedup", "explicit/SDPA", "{:.2f}x"),
                 Column("scores_mb", "(T,T) scores MB", "{:.1f}"),
                 Column("saved_explicit_mb", "saved MB explicit", "{:.1f}"),
                 Column("saved_sdpa_mb", "saved MB SDPA", "{:.1f}")],
        rows=rows,
        notes=["forward runs under torch.no_grad; forward+backward backpropagates a random output gradient.",
               "(T,T) scores MB = B*H*T*T*4 bytes, one fp32 score matrix per head; 'saved MB' = tensors "
               "autograd keeps for backward (saved_tensors_hooks, each storage once, q/k/v excluded)."])

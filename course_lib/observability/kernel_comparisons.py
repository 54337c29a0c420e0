"""Fused versus unfused kernels, measured on the CPU: what one kernel doing the work of many buys.

Every PyTorch operation is a kernel: on a GPU, one launch (a few microseconds of CPU and driver work before the
GPU starts) and one pass over its tensors in memory. A chain of elementwise operations therefore pays one launch
and one round trip to memory per operation, and writes intermediates that the next operation reads back. A
*fused* kernel does the whole chain in one launch and one pass. Three examples, each timed here with medians of
alternating runs and counted with `record_ops` (the operations that reach the dispatcher, i.e. the kernels):

- SiLU: `x * torch.sigmoid(x)` (two kernels, an intermediate tensor) vs `F.silu(x)` (one kernel);
- AdamW: `foreach=False` (about ten kernels per parameter tensor), `foreach=True` (about ten kernels, each over
  the list of all tensors), `fused=True` (one kernel for the whole update, plus one to advance the step counters);
- attention: softmax(q k^T / sqrt(d) + mask) v written out (the (T, T) scores go to memory and back) vs
  `F.scaled_dot_product_attention` (a flash-attention style kernel that never stores them).

    python -m course_lib.observability.kernel_comparisons            # the three comparisons: medians, ratios, kernels and bytes touched
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib.core.checks import positive_int
from course_lib.core.model import GPT, GPTConfig, causal_attention
from course_lib.observability.timing import machine_line, time_alternating

ADAMW_IMPLS = ("for-loop", "foreach", "fused")
# Dispatched operations that are not kernels over tensor data: profiler markers, reading one number into Python
# (`.item()`, e.g. of AdamW's step counters), wrapping a constant, and a reshape that aliases its input. Views
# (view, transpose, slice, ...) are recognised by their schema.
NOT_KERNELS = frozenset({"_record_function_enter_new", "_record_function_exit", "_local_scalar_dense", "lift_fresh",
                         "_unsafe_view"})


@dataclass(frozen=True)
class OpCall:
    """One operation as the dispatcher saw it: its name, the dtypes of its tensor inputs and outputs, the bytes
    of the distinct tensors it reads or writes (its minimum memory traffic), and whether it is a view (a new
    shape over the same memory: no kernel, no traffic)."""

    name: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    bytes_touched: int
    is_view: bool = False


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _OpRecorder(TorchDispatchMode):
    """Sees every operation below autograd and autocast, after they have decided what to run."""

    def __init__(self):
        super().__init__()
        self.calls: list[OpCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        storages = {}
        for t in inputs + outputs:  # an in-place op reads and writes the same storage: count it once
            storages[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.element_size()
        self.calls.append(OpCall(func.overloadpacket.__name__, tuple(_short(t.dtype) for t in inputs),
                                 tuple(_short(t.dtype) for t in outputs), sum(storages.values()), func.is_view))
        return out


def record_ops(fn: Callable[[], object], *, kernels_only: bool = True) -> list[OpCall]:
    """Run fn() once and return the operations it dispatched, in order: each is one kernel (launch) on a GPU.

    kernels_only=False keeps views, the bookkeeping operations of NOT_KERNELS and operations that return no
    tensor (torch.promote_types, for one, passes through the dispatcher too) as well.
    """
    with _OpRecorder() as recorder:
        fn()
    return [c for c in recorder.calls
            if not kernels_only or not (c.is_view or c.name in NOT_KERNELS or not c.output_dtypes)]


def op_summary(calls: list[OpCall]) -> dict:
    """{'kernels': number of operations, 'bytes_touched': their summed traffic, 'by_name': Counter of names}."""
    return {"kernels": len(calls), "bytes_touched": sum(c.bytes_touched for c in calls),
            "by_name": Counter(c.name for c in calls)}


def _compare(variants: dict[str, Callable[[], object]], baseline: str, rounds: int, warmup: int) -> list[dict]:
    """Time the variants in alternation; one row per variant with its median, its speed-up over the baseline
    (baseline median / its median) and its kernels and bytes per call."""
    timings = time_alternating(variants, warmup=warmup, rounds=rounds)
    rows = []
    for name, fn in variants.items():
        summary = op_summary(record_ops(fn))
        rows.append({"variant": name, "median_ms": timings[name].median * 1e3,
                     "spread": timings[name].relative_spread,
                     "speedup": timings[baseline].median / timings[name].median,
                     "kernels": summary["kernels"], "mb_touched": summary["bytes_touched"] / 2**20})
    return rows


def silu_comparison(numel: int = 2**22, rounds: int = 15, warmup: int = 3, seed: int = 0) -> dict:
    """x * sigmoid(x) in two kernels vs F.silu in one; returns {'rows': ..., 'outputs': {variant: tensor}}."""
    positive_int("numel", numel)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    variants = {"x * sigmoid(x)": lambda: x * torch.sigmoid(x), "F.silu(x)": lambda: F.silu(x)}
    return {"rows": _compare(variants, "x * sigmoid(x)", rounds, warmup),
            "outputs": {name: fn() for name, fn in variants.items()}}


def make_adamw(params: list[torch.Tensor], impl: str, lr: float = 1e-3) -> torch.optim.AdamW:
    """AdamW with one of ADAMW_IMPLS: 'for-loop' (foreach=False), 'foreach' or 'fused'."""
    if impl not in ADAMW_IMPLS:
        raise ValueError(f"impl must be one of {ADAMW_IMPLS}, got {impl!r}")
    options = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **options)


def adamw_comparison(shapes: list[tuple[int, ...]], rounds: int = 15, warmup: int = 3, seed: int = 0) -> dict:
    """One AdamW step over parameters of these shapes, three implementations taking turns.

    Each implementation updates its own copy of the same parameters with the same gradients, so after the
    run (warmup + rounds + 1 steps each) their parameters must agree. Returns {'rows', 'params': {impl: list}}.
    """
    if not shapes:
        raise ValueError("shapes is empty: give the shapes of the parameter tensors, e.g. [(256, 64), (64,)]")
    generator = torch.Generator().manual_seed(seed)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    params, steps = {}, {}
    for impl in ADAMW_IMPLS:
        params[impl] = [p.clone().requires_grad_() for p in initial]
        for p, g in zip(params[impl], grads):
            p.grad = g.clone()
        steps[impl] = make_adamw(params[impl], impl).step
    rows = _compare(steps, "for-loop", rounds, warmup)
    n_params = sum(p.numel() for p in initial)
    for row in rows:
        row.update(tensors=len(shapes), parameters=n_params)
    return {"rows": rows, "params": {impl: [p.detach() for p in ps] for impl, ps in params.items()}}


def attention_comparison(batch: int = 4, n_head: int = 4, seq_len: int = 256, head_dim: int = 32,
                         backward: bool = False, rounds: int = 10, warmup: int = 2, seed: int = 0) -> dict:
    """Causal attention written out (course_lib.core.model.causal_attention) vs F.scaled_dot_product_attention.

    backward=True times forward + backward. Returns {'rows', 'outputs': {variant: output}, 'scores_mb'}, where
    scores_mb is the size of one (B, n_head, T, T) fp32 score matrix: what the explicit path writes and reads.
    """
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n_head, seq_len, head_dim, generator=generator).requires_grad_(backward)
               for _ in range(3))

    def run(attention):
        def call():
            out = attention(q, k, v)
            if backward:
                out.sum().backward()
            return out.detach()
        return call

    variants = {"explicit": run(causal_attention),
                "sdpa": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))}
    return {"rows": _compare(variants, "explicit", rounds, warmup),
            "outputs": {name: fn() for name, fn in variants.items()},
            "scores_mb": batch * n_head * seq_len * seq_len * 4 / 2**20}


def format_rows(rows: list[dict]) -> str:
    """A fixed-width table of comparison rows."""
    lines = [f"{'variant':>16s} {'median ms':>10s} {'IQR/median':>10s} {'speed-up':>9s} {'kernels':>8s} "
             f"{'MiB touched':>11s}"]
    for r in rows:
        lines.append(f"{r['variant']:>16s} {r['median_ms']:>10.3f} {r['spread']:>10.0%} {r['speedup']:>8.2f}x "
                     f"{r['kernels']:>8d} {r['mb_touched']:>11.1f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Fused vs unfused kernels on this CPU (medians, alternating).")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    print(machine_line())
    print("\nSiLU over 4M floats\n" + format_rows(silu_comparison(rounds=args.rounds)["rows"]))
    shapes = [tuple(p.shape) for p in GPT(GPTConfig.from_preset("small")).parameters()]
    print(f"\nAdamW step, parameters of the 'small' preset ({len(shapes)} tensors)\n"
          + format_rows(adamw_comparison(shapes, rounds=args.rounds)["rows"]))
    result = attention_comparison(rounds=args.rounds)
    print(f"\nCausal attention forward, B=4, 4 heads, T=256, head_dim=32 (scores {result['scores_mb']:.0f} MiB)\n"
          + format_rows(result["rows"]))


if __name__ == "__main__":
    main()

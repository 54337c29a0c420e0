"""Profile section of `make bench`: where a plain eager training step spends its time.

    .venv/bin/python scripts/bench.py --only profile

torch.profiler records every operator's self time (time not spent in the operators it calls); the shares
are GEMMs, the SDPA kernels, the optimizer, every other operator, and the wall time outside operators.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from course_lib.observability.profiling import category_shares, without_profiler_banner
from course_tools.bench.compute import TRAIN_VARIANTS, variant_train_step
from course_tools.bench.report import Column, Options, Table

PROFILE_SHARES = {
    "matmul": "GEMM %",
    "attention": "SDPA kernels %",
    "optimizer": "AdamW + zero_grad %",
    "other operators": "other ops %",
    "outside operators": "outside ops %",
}
"""The columns: course_lib.observability.profiling's categories (a one-process step has no communication)."""


def step_time_shares(step: Callable[[], None], steps: int = 3) -> dict[str, float]:
    """Fractions of the wall time of `steps` profiled steps, by where the time went (see PROFILE_SHARES).

    Each operator's self time (time not spent in the operators it calls) is summed per category;
    'outside operators' is the wall time no operator accounts for: Python, autograd bookkeeping, dispatch
    and the profiler's own overhead.
    """
    from torch.profiler import ProfilerActivity, profile

    with without_profiler_banner():
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        wall_us = (time.perf_counter() - start) * 1e6
    shares = category_shares(prof.events(), wall_us)
    return {name: shares[name] for name in PROFILE_SHARES}


def run_profile(opts: Options) -> Table:
    """Where one plain eager fp32 training step spends its time (torch.profiler, self time per operator)."""
    rows = []
    for variant in [v for v in TRAIN_VARIANTS if v.plain and (v.quick or not opts.quick)]:
        _, step, _, seq_len = variant_train_step(variant)
        for _ in range(2):  # warm-up
            step()
        shares = step_time_shares(step, steps=2 if opts.quick else 5)
        rows.append({"preset": variant.preset, "variant": variant.label, "batch_size": variant.batch_size,
                     "seq_len": seq_len, **{k: 100 * v for k, v in shares.items()}})
    return Table(
        title="Where a training step's time goes (percent of profiled wall time)",
        columns=[Column("preset", "preset"), Column("variant", "variant"), Column("batch_size", "B"),
                 Column("seq_len", "T")] + [Column(k, h, "{:.0f}") for k, h in PROFILE_SHARES.items()],
        rows=rows,
        notes=["GEMM = aten::mm/addmm/bmm (every nn.Linear, forward and backward); other ops = RMSNorm, rotary, "
               "SiLU * up, residual adds, cross-entropy, copies: memory-bound work; outside ops = Python, "
               "autograd and profiler overhead. The FLOPs that 6N + 12LHQT counts are done inside the GEMM and "
               "SDPA kernels; every other microsecond earns none, so the train section's fraction of the matmul "
               "ceiling stays below the GEMM + SDPA share."])

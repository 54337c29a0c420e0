"""Profile section of `make bench`: where a plain eager training step spends its time.

    .venv/bin/python scripts/bench.py --only profile

torch.profiler records every operator's self time (time not spent in the operators it calls); the shares
are GEMMs, the SDPA kernels, the optimizer, every other operator, and the wall time outside operators.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from course_lib.bench.compute import TRAIN_VARIANTS, make_train_step
from course_lib.bench.report import Column, Options, Table
from course_lib.observability.profiling import without_profiler_banner

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
PROFILE_SHARES = {
    "gemm": "GEMM %",
    "attention": "SDPA kernels %",
    "optimizer": "AdamW + zero_grad %",
    "other_ops": "other ops %",
    "outside_ops": "outside ops %",
}


def _category(event) -> str:
    node = event
    while node is not None:  # anything called inside the optimizer counts as optimizer time
        if node.name.startswith(("Optimizer.step", "Optimizer.zero_grad")):
            return "optimizer"
        node = node.cpu_parent
    if event.name in GEMM_OPS:
        return "gemm"
    return "attention" if "scaled_dot_product" in event.name else "other_ops"


def step_time_shares(step: Callable[[], None], steps: int = 3) -> dict[str, float]:
    """Fractions of the wall time of `steps` profiled steps, by where the time went (see PROFILE_SHARES).

    Each operator's self time (time not spent in the operators it calls) is summed per category;
    'outside_ops' is the wall time no operator accounts for: Python, autograd bookkeeping, dispatch
    and the profiler's own overhead.
    """
    from torch.profiler import ProfilerActivity, profile

    shares = dict.fromkeys(PROFILE_SHARES, 0.0)
    with without_profiler_banner():
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        wall_us = (time.perf_counter() - start) * 1e6
    for event in prof.events():
        shares[_category(event)] += event.self_cpu_time_total
    # Clock granularity can make the operators' sum exceed the wall time by a hair: then nothing is outside.
    total_us = max(wall_us, sum(shares.values()))
    shares["outside_ops"] = total_us - sum(shares.values())
    return {name: us / total_us for name, us in shares.items()}


def run_profile(opts: Options) -> Table:
    """Where one plain eager fp32 training step spends its time (torch.profiler, self time per operator)."""
    rows = []
    for variant in [v for v in TRAIN_VARIANTS if v.plain and (v.quick or not opts.quick)]:
        _, step, _, seq_len = make_train_step(variant)
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

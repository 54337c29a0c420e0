"""Context and experts sections of `make bench`: ring attention (context parallelism) and an expert-parallel MoE
layer at 1, 2 and 4 ranks, the same global work at every size, with the bytes each rank sends against the formulas.

    .venv/bin/python scripts/bench.py --only context,experts          # ~1 min on a quiet 2-core machine
    .venv/bin/python scripts/bench.py --only context,experts --quick  # ~15 s

context: one sequence of T positions, B x H heads of d dimensions, split over N ranks (contiguous, then zigzag),
forward and backward of causal ring attention (course_lib.context_parallel). Per rank, forward sends its key/value
block on N - 1 times: (N-1) x 2 x B H (T/N) d x 4 bytes; backward sends the block with its two gradients N - 1 times
and the gradients once more: (4 (N-1) + 2) x B H (T/N) d x 4 bytes. The balance is the most query-key pairs a rank
computes over the fewest: contiguous leaves rank N-1 with about 2N - 1 times rank 0's work, zigzag evens it.

experts: `tokens` tokens in all, tokens/N per rank, through a MoE layer of E experts, top-k routing with a capacity
C = ceil(capacity factor x (tokens/N) x k / E) per expert (course_lib.expert_parallel). Each all-to-all moves the
rank's E x C x d buffer, (N-1)/N of it to other ranks; a step runs four (dispatch and combine, forward and backward).
"""

from __future__ import annotations

import math
import os
import tempfile

from course_lib.observability.timing import Timing
from course_lib.runtime.launch import launch
from course_tools.bench.cp_ep_workers import CONTEXT_LAYOUTS, context_bench, experts_bench
from course_tools.bench.report import Column, Options, Table, agreement, megabytes, oversubscribed_note, ranks_setup

RANKS = (1, 2, 4)
FP32_BYTES = 4
CONTEXT_WORKLOAD = {"full": {"seq_len": 2048, "batch": 1, "heads": 4, "head_dim": 32, "warmup": 1, "steps": 5},
                    "quick": {"seq_len": 256, "batch": 1, "heads": 2, "head_dim": 16, "warmup": 1, "steps": 2}}
EXPERTS_WORKLOAD = {"full": {"tokens": 2048, "d_model": 128, "hidden": 512, "n_experts": 8, "top_k": 2,
                             "capacity_factor": 1.25, "warmup": 1, "steps": 5},
                    "quick": {"tokens": 256, "d_model": 32, "hidden": 64, "n_experts": 4, "top_k": 2,
                              "capacity_factor": 1.25, "warmup": 1, "steps": 2}}


def ring_bytes(world_size: int, block_elements: int) -> dict[str, int]:
    """Bytes one rank sends in ring attention's forward and backward (course_lib.context_parallel.ring), fp32."""
    n = world_size
    return {"forward": (n - 1) * 2 * block_elements * FP32_BYTES,
            "backward": (4 * (n - 1) + 2) * block_elements * FP32_BYTES if n > 1 else 0}


def _launches(worker, workload: dict, prefix: str) -> dict[int, list[dict]]:
    with tempfile.TemporaryDirectory(prefix=prefix) as log_dir:
        return {n: launch(worker, n, kwargs=workload, threads_per_rank=1, log_dir=log_dir, echo=False, timeout_s=300)
                for n in RANKS}


def context_rows(by_size: dict[int, list[dict]], workload: dict) -> list[dict]:
    rows, base = [], None
    for n, ranks in by_size.items():
        for layout in CONTEXT_LAYOUTS if n > 1 else CONTEXT_LAYOUTS[:1]:
            per_rank = [r["layouts"][layout] for r in ranks]
            timing = Timing(tuple(per_rank[0]["step_samples"]))
            expected = ring_bytes(n, per_rank[0]["block_elements"])
            sent = {phase: max(r["sent_elements"][phase] for r in per_rank) * FP32_BYTES for phase in expected}
            pairs = [r["pairs"]["forward"] for r in per_rank]
            row = {"strategy": "one process" if n == 1 else f"ring, {layout}", "world_size": n,
                   "seq_len": workload["seq_len"], "step_ms": timing.median * 1e3, "step_spread": timing.relative_spread,
                   "tokens_per_s": workload["seq_len"] / timing.median,
                   "forward_bytes": sent["forward"], "expected_forward_bytes": expected["forward"],
                   "backward_bytes": sent["backward"], "expected_backward_bytes": expected["backward"],
                   "agrees": all(r["sent_elements"][p] * FP32_BYTES == expected[p] for r in per_rank for p in expected),
                   "balance": max(pairs) / min(pairs), "pairs_per_rank": pairs, "threads_per_rank": ranks[0]["threads"]}
            base = base or row
            row["speedup"] = base["step_ms"] / row["step_ms"]
            rows.append(row)
    return rows


def experts_rows(by_size: dict[int, list[dict]], workload: dict) -> list[dict]:
    rows, base = [], None
    for n, ranks in by_size.items():
        timing = Timing(tuple(ranks[0]["step_samples"]))
        per_rank_tokens = workload["tokens"] // n
        capacity = math.ceil(workload["capacity_factor"] * per_rank_tokens * workload["top_k"] / workload["n_experts"])
        buffer = workload["n_experts"] * capacity * workload["d_model"]
        calls = [r["all_to_all_elements"] for r in ranks]
        kept = sum(r["stats"]["kept"] for r in ranks)
        dropped = sum(r["stats"]["dropped"] for r in ranks)
        row = {"world_size": n, "tokens": workload["tokens"], "capacity": capacity,
               "step_ms": timing.median * 1e3, "step_spread": timing.relative_spread,
               "tokens_per_s": workload["tokens"] / timing.median,
               "all_to_all_elements": max(max(c) for c in calls), "expected_elements": buffer,
               "all_to_alls": max(len(c) for c in calls),
               "agrees": all(c == [buffer] * 4 for c in calls),
               "off_rank_bytes": 4 * buffer * FP32_BYTES * (n - 1) / n,
               "dropped": dropped / (kept + dropped), "threads_per_rank": ranks[0]["threads"]}
        base = base or row
        row["speedup"] = base["step_ms"] / row["step_ms"]
        rows.append(row)
    return rows


def run_context(opts: Options) -> Table:
    """Ring attention forward and backward at 1, 2 and 4 ranks: step time, bytes sent per rank, work balance."""
    workload = CONTEXT_WORKLOAD["quick" if opts.quick else "full"]
    rows = context_rows(_launches(context_bench, workload, "bench_context_"), workload)
    cores = os.cpu_count() or 1
    w = workload
    return Table(
        title="context parallelism: ring attention over one sequence at 1, 2 and 4 ranks (forward + backward)",
        setup=ranks_setup(RANKS, cores),
        columns=[Column("strategy", "attention"), Column("world_size", "ranks"),
                 Column("step_ms", "step ms", "{:.1f}"), Column("step_spread", "IQR", "{:.0%}"),
                 Column("tokens_per_s", "positions/s", "{:,.0f}"), Column("speedup", "vs 1 rank", "{:.2f}x"),
                 Column("forward_bytes", "fwd MB", megabytes("forward_bytes")),
                 Column("backward_bytes", "bwd MB", megabytes("backward_bytes")),
                 Column("agrees", "= formula", agreement("forward_bytes", "expected_forward_bytes")),
                 Column("balance", "work max/min", "{:.2f}")],
        rows=rows,
        notes=[f"one sequence of T = {w['seq_len']} positions, batch {w['batch']}, {w['heads']} heads of d = "
               f"{w['head_dim']}, fp32, causal; each rank holds T/N positions of q, k, v. step ms = median of "
               f"{w['steps']} steps (after {w['warmup']} warm-up) of the slowest rank, forward and backward.",
               "fwd/bwd MB = bytes the busiest rank sends (RingStats, elements x 4); formula: forward (N-1) x 2 "
               "blocks of k and v, backward (4 (N-1) + 2) blocks (k, v, dk, dv passed on N-1 times, dk and dv once "
               "more to reach home), a block being B H (T/N) d floats. '= formula' is yes when every rank sends "
               "exactly that in both passes.",
               "work max/min = the most query-key pairs a rank computes over the fewest: a contiguous split gives "
               "the last rank every earlier block, zigzag (chunks r and 2N-1-r) gives every rank the same.",
               "At 1 rank the sequence is one block, computed whole under its causal mask (half of it wasted); the "
               "ring skips the blocks the mask hides and works on smaller blocks, so 2 ranks can be more than "
               "twice as fast as 1.",
               *oversubscribed_note(RANKS, cores, " (each ring pass waits for the slowest rank)")])


def run_experts(opts: Options) -> Table:
    """An expert-parallel MoE layer at 1, 2 and 4 ranks: step time, all-to-all sizes, bytes to other ranks."""
    workload = EXPERTS_WORKLOAD["quick" if opts.quick else "full"]
    rows = experts_rows(_launches(experts_bench, workload, "bench_experts_"), workload)
    cores = os.cpu_count() or 1
    w = workload
    return Table(
        title="expert parallelism: a MoE layer's experts over 1, 2 and 4 ranks, two all-to-alls each way",
        setup=ranks_setup(RANKS, cores),
        columns=[Column("world_size", "ranks"), Column("capacity", "C"),
                 Column("step_ms", "step ms", "{:.1f}"), Column("step_spread", "IQR", "{:.0%}"),
                 Column("tokens_per_s", "tokens/s", "{:,.0f}"), Column("speedup", "vs 1 rank", "{:.2f}x"),
                 Column("all_to_all_elements", "all-to-all elems"), Column("all_to_alls", "per step"),
                 Column("agrees", "= E C d", agreement("all_to_all_elements", "expected_elements")),
                 Column("off_rank_bytes", "off-rank MB", megabytes("off_rank_bytes")),
                 Column("dropped", "dropped", "{:.1%}")],
        rows=rows,
        notes=[f"{w['tokens']} tokens in all (tokens/N per rank), d = {w['d_model']}, E = {w['n_experts']} experts "
               f"of hidden {w['hidden']}, top-{w['top_k']} routing, capacity factor {w['capacity_factor']}: C = "
               "ceil(factor x (tokens/N) x k / E) slots per expert and rank. step ms = median of "
               f"{w['steps']} steps (after {w['warmup']} warm-up) of the slowest rank, forward and backward.",
               "all-to-all elems = the largest all_to_all_single a rank called, against its E x C x d buffer; a step "
               "runs 4 (dispatch and combine, forward and backward). off-rank MB = 4 x E C d x 4 bytes x (N-1)/N per "
               "rank per step, empty slots included. dropped = assignments past an expert's capacity, all ranks.",
               *oversubscribed_note(RANKS, cores, " (every all-to-all waits for the slowest rank)")])

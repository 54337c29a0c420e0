"""Communication section of `make bench`: all-reduce bandwidth, and what data parallelism does to tokens/s.

    .venv/bin/python scripts/bench.py --only comm            # ~1-2 min on a quiet 2-core machine
    .venv/bin/python scripts/bench.py --only comm --quick    # ~30 s: fewer sizes, steps and turns

Both tables come from real ranks started with course_lib.runtime.launch (gloo over loopback TCP), running the
workers of course_tools.bench.comm_workers:

- all_reduce: torch.distributed.all_reduce (gloo) and the course's ring (course_lib.data_parallel.collectives: send/recv from
  Python) on 1-64 MiB of fp32 at 2 and 4 ranks; the two take turns at every size. algbw = bytes / median
  time of the slowest rank; busbw = algbw * 2 (n - 1) / n, as nccl-tests define it.
- throughput: DDP training of the small preset at one global batch, 1 rank x every core against 2 ranks x
  half the cores each. Whole launches take turns (A B A B ...); each setup's step times are pooled into
  one median.
"""

from __future__ import annotations

import os
import tempfile

from course_lib.core.model import GPT, GPTConfig
from course_lib.observability.timing import Timing
from course_lib.runtime.launch import launch
from course_tools.bench.comm_workers import allreduce_bandwidth, ddp_throughput
from course_tools.bench.report import Column, Options, Table

ALLREDUCE_RANKS = (2, 4)
ALLREDUCE_SIZES_MIB = {"full": (1, 4, 16, 64), "quick": (1, 4)}
ALLREDUCE_CALLS = {"full": {"warmup": 2, "iters": 10}, "quick": {"warmup": 1, "iters": 3}}

THROUGHPUT_WORKLOAD = {"preset": "small", "global_batch": 16, "seq_len": 128}
"""The train section's small row (B=16, T=128): the 1-rank figure can be read next to it."""
THROUGHPUT_TURNS = {"full": {"rounds": 3, "warmup": 2, "steps": 10}, "quick": {"rounds": 1, "warmup": 1, "steps": 3}}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _setup(ranks: int, threads: int) -> str:
    return f"{_plural(ranks, 'rank')} x {_plural(threads, 'thread')}"


def _launch(worker, ranks: int, threads: int, kwargs: dict, log_dir: str):
    """Rank 0's result: the workers time the slowest rank, so every rank returns the same figures."""
    return launch(worker, ranks, kwargs=kwargs, threads_per_rank=threads, log_dir=log_dir, echo=False)[0]


def run_all_reduce(opts: Options, cores: int, log_dir: str) -> Table:
    mode = "quick" if opts.quick else "full"
    calls = ALLREDUCE_CALLS[mode]
    rows, setups = [], []
    for ranks in ALLREDUCE_RANKS:
        threads = max(1, cores // ranks)
        oversubscribed = ranks * threads > cores
        setups.append(_setup(ranks, threads) + (f" ({ranks} processes on {cores} cores: oversubscribed)"
                                                if oversubscribed else ""))
        measured = _launch(allreduce_bandwidth, ranks, threads, log_dir=log_dir,
                           kwargs={"sizes_mib": ALLREDUCE_SIZES_MIB[mode], "impls": ("gloo", "ring"), **calls})
        gloo_seconds = {r["size_mib"]: r["seconds"] for r in measured if r["impl"] == "gloo"}
        for r in measured:
            ratio = r["seconds"] / gloo_seconds[r["size_mib"]] if r["impl"] == "ring" else None
            rows.append({**r, "ms": r["seconds"] * 1e3, "threads_per_rank": threads,
                         "oversubscribed": oversubscribed, "ring_over_gloo": ratio})
    notes = [f"algbw = MiB x 2^20 bytes / median time of the slowest rank ({calls['iters']} timed calls after "
             f"{calls['warmup']} warm-up); busbw = algbw x 2(n-1)/n for n ranks: the bytes each rank sends per "
             "second in a ring all-reduce, comparable across n (nccl-tests). gloo = torch.distributed.all_reduce; "
             "ring = course_lib.data_parallel.collectives.ring_all_reduce (send/recv from Python). The two take turns at every size; "
             "ring/gloo = ring's median time / gloo's."]
    crowded = [r for r in ALLREDUCE_RANKS if r * max(1, cores // r) > cores]
    if crowded:
        notes.append(f"{' and '.join(map(str, crowded))} ranks on {cores} cores are oversubscribed "
                     "(threads_per_rank=1, more processes than cores): the ranks take turns on the cores, so "
                     "those rows include waiting for a CPU, not only moving bytes.")
    return Table(
        name="all_reduce",
        title="all_reduce of fp32 tensors over gloo: algbw and busbw, gloo's against the from-scratch ring",
        setup=", then ".join(setups),
        columns=[Column("impl", "impl"), Column("world_size", "ranks"), Column("size_mib", "MiB"),
                 Column("ms", "median ms", "{:.2f}"), Column("algbw_gbs", "algbw GB/s", "{:.3f}"),
                 Column("busbw_gbs", "busbw GB/s", "{:.3f}"), Column("ring_over_gloo", "ring/gloo", "{:.2f}x")],
        rows=rows, notes=notes)


def run_throughput(opts: Options, cores: int, log_dir: str) -> Table:
    turns = THROUGHPUT_TURNS["quick" if opts.quick else "full"]
    setups = [(1, cores), (2, max(1, cores // 2))]
    samples: dict[tuple[int, int], list[float]] = {s: [] for s in setups}
    workload = {**THROUGHPUT_WORKLOAD, "warmup": turns["warmup"], "steps": turns["steps"]}
    for _ in range(turns["rounds"]):  # A B A B: each launch of one setup is followed by one of the other
        for ranks, threads in setups:
            result = _launch(ddp_throughput, ranks, threads, workload, log_dir)
            samples[(ranks, threads)].extend(result["step_samples"])
    tokens_per_step = THROUGHPUT_WORKLOAD["global_batch"] * THROUGHPUT_WORKLOAD["seq_len"]
    rows = []
    for ranks, threads in setups:
        timing = Timing(tuple(samples[(ranks, threads)]))
        rows.append({"setup": f"{ranks} x {threads}", "world_size": ranks, "threads_per_rank": threads,
                     "oversubscribed": ranks * threads > cores, **THROUGHPUT_WORKLOAD,
                     "local_batch": THROUGHPUT_WORKLOAD["global_batch"] // ranks, "tokens_per_step": tokens_per_step,
                     "steps": len(timing.samples), "step_ms": timing.median * 1e3,
                     "step_spread": timing.relative_spread, "tokens_per_s": tokens_per_step / timing.median})
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    model = GPT(GPTConfig.from_preset(THROUGHPUT_WORKLOAD["preset"]))
    grad_mb = model.num_params() * 4 / 1e6
    (r1, t1), (r2, t2) = setups
    notes = [f"Same global batch in both rows: {THROUGHPUT_WORKLOAD['global_batch']} sequences of "
             f"{THROUGHPUT_WORKLOAD['seq_len']} tokens per optimizer step ({tokens_per_step:,} tokens), "
             f"{THROUGHPUT_WORKLOAD['preset']} preset ({model.num_params():,} parameters), torch DDP + AdamW. "
             f"{_setup(r1, t1)} splits every operator over its threads; {_setup(r2, t2)} run half the batch each "
             f"and all-reduce {grad_mb:.1f} MB of fp32 gradients per step (DDP overlaps it with backward).",
             f"Launches took turns ({turns['rounds']} x each setup, {turns['steps']} timed steps after "
             f"{turns['warmup']} warm-up per launch); step ms = median of the pooled step times of the slowest "
             f"rank, IQR their spread; tokens/s = tokens per step / step time; ratio = tokens/s / that of "
             f"{_setup(r1, t1)}."]
    if any(row["oversubscribed"] for row in rows):
        notes.append(f"With {_plural(cores, 'core')}, {_setup(r2, t2)} oversubscribe the machine.")
    return Table(
        name="throughput",
        title=f"DDP training tokens/s at one global batch: {_setup(r1, t1)} against {_setup(r2, t2)}",
        setup=f"{_setup(r1, t1)} and {_setup(r2, t2)}, launches taking turns",
        columns=[Column("setup", "ranks x threads"), Column("global_batch", "global batch"),
                 Column("local_batch", "per rank"), Column("seq_len", "T"), Column("step_ms", "step ms", "{:.1f}"),
                 Column("step_spread", "IQR", "{:.0%}"), Column("tokens_per_s", "tokens/s", "{:,.0f}"),
                 Column("ratio", f"vs {r1} x {t1}", "{:.2f}x")],
        rows=rows, notes=notes)


def run_comm(opts: Options) -> list[Table]:
    """The all_reduce table, then the throughput table; rank logs go to a temporary directory."""
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench_comm_") as log_dir:
        return [run_all_reduce(opts, cores, log_dir), run_throughput(opts, cores, log_dir)]

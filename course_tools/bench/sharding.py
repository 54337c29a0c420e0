"""Sharding section of `make bench`: bytes per rank and time per step of DDP, ZeRO-1/2/3 and FSDP, at 2 and 4 ranks.

    .venv/bin/python scripts/bench.py --only sharding            # ~1 min on a quiet 2-core machine (small preset)
    .venv/bin/python scripts/bench.py --only sharding --quick    # ~20 s: tiny preset, 3 timed steps

One launch per world size (course_lib.runtime.launch, gloo, 1 thread per rank) runs the worker of
course_tools.bench.sharding_workers: every strategy trains its own copy of the same model on the same global
batches, one step each per round, each right after every other equally often. Per rank, right after the last
optimizer step, the live tensors of parameters, gradients and optimizer states are counted
(course_lib.sharding.model_states) and compared with the formulas: course_lib.sharding.model_states.expected_model_states (DDP,
ZeRO) and course_lib.sharding.fsdp.expected_fsdp_model_states (FSDP2, which pads every parameter's dim 0).
"""

from __future__ import annotations

import os

from course_tools.bench.report import (Column, Options, Table, add_ratios, agreement, megabytes, oversubscribed_note,
                                     ranks_setup, strategy_rows)
from course_lib.observability.timing import Timing
from course_lib.sharding.model_states import KINDS
from course_tools.bench.sharding_workers import DATA_PARALLEL_STRATEGIES, sharding_bench

SHARDING_RANKS = (2, 4)
WORKLOAD = {"full": {"preset": "small", "global_batch": 8, "seq_len": 128, "warmup": 2, "steps": 20},
            "quick": {"preset": "tiny", "global_batch": 8, "seq_len": 64, "warmup": 1, "steps": 3}}
"""fp32 AdamW, the same global batch (sequences x tokens) at every world size; warm-up rounds are not timed."""
BYTE_KEYS = {"params": "params_bytes", "grads": "grads_bytes", "optimizer_states": "optimizer_bytes",
             "total": "total_bytes"}


def sharding_rows(ranks: list[dict], *, cores: int, workload: dict) -> list[dict]:
    """One row per strategy from the results of every rank of one launch (see sharding_bench)."""
    world_size = len(ranks)
    rows = []
    for name in ranks[0]["strategies"]:
        per_rank = [r["strategies"][name] for r in ranks]
        timing = Timing(tuple(per_rank[0]["step_samples"]))  # every rank holds the slowest rank's times
        row = {"strategy": name, "world_size": world_size, "threads_per_rank": ranks[0]["threads"],
               "oversubscribed": world_size * ranks[0]["threads"] > cores, "preset": workload["preset"],
               "n_params": per_rank[0]["n_params"], "global_batch": workload["global_batch"],
               "local_batch": workload["global_batch"] // world_size, "seq_len": workload["seq_len"]}
        # Ranks differ by padding (the last shards hold it): each column is its own maximum over the ranks.
        row.update({key: max(r["memory"][kind] for r in per_rank) for kind, key in BYTE_KEYS.items()})
        row["expected_total_bytes"] = max(r["expected"]["total"] for r in per_rank)
        row["agrees"] = all(r["memory"][k] == r["expected"][k] for r in per_rank for k in (*KINDS, "total"))
        row["peak_params_bytes"] = max(r["peak_params"] for r in per_rank)
        row["peak_grads_bytes"] = max(r["peak_grads"] for r in per_rank)
        gathered = [r["peak_gathered"] for r in per_rank if r["peak_gathered"] is not None]
        row["zero3_peak_gathered_bytes"] = max(gathered) if gathered else None
        row.update({"steps": len(timing.samples), "step_ms": timing.median * 1e3,
                    "step_spread": timing.relative_spread})
        rows.append(row)
    return add_ratios(rows, "DDP", {"vs_ddp": "total_bytes", "time_vs_ddp": "step_ms"})


def run_sharding(opts: Options, strategies=DATA_PARALLEL_STRATEGIES) -> Table:
    """DDP, ZeRO-1/2/3 and FSDP at 2 and 4 ranks: model-state bytes per rank against the formulas, step time."""
    workload, rows = strategy_rows(sharding_bench, SHARDING_RANKS, opts, WORKLOAD, strategies, sharding_rows,
                                   log_prefix="bench_sharding_")
    cores = os.cpu_count() or 1
    first = rows[0]
    tokens = workload["global_batch"] * workload["seq_len"]
    notes = [
        f"{first['preset']} preset ({first['n_params']:,} parameters), fp32 AdamW, one global batch of "
        f"{workload['global_batch']} x {workload['seq_len']} tokens ({tokens:,}) per step at every world size. "
        "DDP = torch DDP; ZeRO-1/2/3 = course_lib.sharding.zero (from scratch); FSDP = torch FSDP2 (course_lib.sharding.fsdp."
        "apply_fsdp, every Block then the root). Each strategy trains its own copy of the same model in the "
        "same ranks, one step per round, each right after every other equally often.",
        "MB per rank (10^6 bytes), counted from live tensors right after the last optimizer step, each storage "
        "once (course_lib.sharding.model_states.measure_model_states): params, grads, optim = AdamW's exp_avg and "
        "exp_avg_sq (torch's AdamW, used by DDP and FSDP, adds a 4-byte step tensor per parameter tensor), "
        "total. Each column is its maximum over the ranks (the last shards carry the padding). formula = "
        "expected_model_states (ZeRO paper: 4+4+8 bytes per parameter, a sharded term 4 or 8 x ceil(P/N)) or "
        "expected_fsdp_model_states (FSDP2 pads every parameter's dim 0 to a multiple of N); '=' is yes when "
        "every rank's params, grads and optim equal its formula to the byte. vs DDP = total / DDP's total.",
        "peak params / peak grads: the most bytes of parameters / gradients held at once during forward and "
        "backward (course_tools.bench.sharding_workers.PeakProbe, in the last warm-up step): ZeRO-3 and FSDP "
        "FULL_SHARD add to their shards only the units gathered at that moment (a block, the embedding tied to "
        "lm_head), SHARD_GRAD_OP keeps the whole gathered model from forward to backward, ZeRO-2/3 hold a full "
        "gradient only until it is reduce-scattered. Activations and the "
        "optimizer step's temporaries (e.g. ZeRO-1/2's all-gather buffer of P elements) are not included.",
        f"step ms = median of {workload['steps']} timed steps (after {workload['warmup']} warm-up) of the "
        "slowest rank; IQR their spread; time vs DDP = step ms / DDP's at the same world size. Compare times "
        "within a world size only. DDP and FSDP bucket their collectives; the from-scratch ZeRO-2/3 issue one "
        "per parameter (and ZeRO-3 one broadcast per owner of each unit), which costs most with many ranks.",
    ] + oversubscribed_note(SHARDING_RANKS, cores)
    return Table(
        title="model-state MB per rank and time per step: DDP, ZeRO-1/2/3, FSDP at 2 and 4 ranks",
        setup=ranks_setup(SHARDING_RANKS, cores),
        columns=[Column("strategy", "strategy"), Column("world_size", "ranks"),
                 Column("params_bytes", "params", megabytes("params_bytes")),
                 Column("grads_bytes", "grads", megabytes("grads_bytes")),
                 Column("optimizer_bytes", "optim", megabytes("optimizer_bytes")),
                 Column("total_bytes", "total", megabytes("total_bytes")),
                 Column("expected_total_bytes", "formula", megabytes("expected_total_bytes")),
                 Column("agrees", "=", agreement("total_bytes", "expected_total_bytes")),
                 Column("vs_ddp", "vs DDP", "{:.2f}x"),
                 Column("peak_params_bytes", "peak params", megabytes("peak_params_bytes")),
                 Column("peak_grads_bytes", "peak grads", megabytes("peak_grads_bytes")),
                 Column("step_ms", "step ms", "{:.1f}"), Column("step_spread", "IQR", "{:.0%}"),
                 Column("time_vs_ddp", "time vs DDP", "{:.2f}x")],
        rows=rows, notes=notes)

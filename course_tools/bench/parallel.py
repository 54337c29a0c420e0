"""Parallel section of `make bench`: step time and bytes communicated per rank by DP, TP and PP at 2 and 4 ranks.

    .venv/bin/python scripts/bench.py --only parallel            # ~1.5 min on a quiet 2-core machine (small preset)
    .venv/bin/python scripts/bench.py --only parallel --quick    # ~20 s: tiny preset with 4 layers, 3 timed steps

One launch per world size (course_lib.runtime.launch, gloo, 1 thread per rank) runs the worker of
course_tools.bench.parallel_workers: data parallelism (torch DDP), tensor parallelism
(course_lib.tensor_parallel.tp_layers) and pipeline parallelism (course_lib.pipeline_parallel.stage, 1F1B and GPipe)
each train their own copy of the same model on the same global batches, one step each per round, in an order
that changes every round (each strategy runs right after every other equally often). Each rank counts the bytes
it hands to all-reduce and send in every step; this module sets them next to the formulas and turns them into
rows:

- DP: the gradient, 4 N bytes (N parameters, fp32), all-reduced once per step;
- TP: 4 b s h bytes x 4 per layer (course_lib.tensor_parallel.tp_layers.tp_allreduce_bytes_per_layer);
- PP: a micro-batch's activations (forward) or their gradients (backward) across each boundary a stage
  touches, plus the tied embedding's gradient on the first and last stage
  (course_lib.pipeline_parallel.schedules.pipeline_comm_bytes).
"""

from __future__ import annotations

import os

from course_tools.bench.parallel_workers import PP_SCHEDULES, PARALLEL_STRATEGIES, parallel_bench
from course_tools.bench.report import (Column, Options, Table, add_ratios, agreement, megabytes, oversubscribed_note,
                                     ranks_setup, strategy_rows)
from course_lib.core.model import GPTConfig
from course_lib.observability.timing import Timing
from course_lib.pipeline_parallel.schedules import pipeline_comm_bytes, predicted_bubble_fraction
from course_lib.tensor_parallel.tp_layers import tp_allreduce_bytes_per_layer

PARALLEL_RANKS = (2, 4)
LAYERS = {"n_layer": 4}
"""Every row's model has 4 blocks, so that 4 pipeline stages get one each (the small preset has 4 already;
tiny's 2 are overridden)."""
WORKLOAD = {"full": {"preset": "small", "config_overrides": LAYERS, "global_batch": 16, "seq_len": 128,
                     "micro_batches": 8, "warmup": 3, "steps": 25},
            "quick": {"preset": "tiny", "config_overrides": LAYERS, "global_batch": 8, "seq_len": 64,
                      "micro_batches": 4, "warmup": 1, "steps": 3}}
"""fp32 AdamW, the same global batch (sequences x tokens) for every strategy and world size."""
FP32_BYTES = 4


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte of payload in a ring all-reduce: reduce-scatter + all-gather, 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


def expected_payload_bytes(strategy: str, config: GPTConfig, n_params: int, world_size: int, rank: int, *,
                           global_batch: int, seq_len: int, micro_batches: int) -> int:
    """Bytes `rank` hands to all-reduce and send in one training step of `strategy`, by formula (fp32)."""
    if strategy == "DP":
        return FP32_BYTES * n_params  # every gradient, all-reduced once
    if strategy == "TP":  # every rank runs the whole batch through its shard of every block
        return config.n_layer * tp_allreduce_bytes_per_layer(global_batch, seq_len, config.n_embd, FP32_BYTES)
    if strategy in PP_SCHEDULES:
        volume = pipeline_comm_bytes(world_size, micro_batches, global_batch // micro_batches, seq_len,
                                     config.n_embd, FP32_BYTES, vocab_size=config.vocab_size)
        first, last = rank == 0, rank == world_size - 1
        boundaries = (not last) + (not first)  # activations go right, their gradients left
        return boundaries * micro_batches * volume["message"] + (first or last) * volume["tied_grad"]
    raise ValueError(f"unknown strategy {strategy!r}; choose from {list(PARALLEL_STRATEGIES)}")


def ring_wire_bytes(strategy: str, payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends for `payload_bytes` of payload when every all-reduce is a ring.

    DP and TP all-reduce over all n ranks: 2(n-1)/n of the payload. PP sends point to point (on the wire as
    they are) and all-reduces the tied gradient over 2 ranks, where 2(2-1)/2 = 1: the payload itself.
    """
    if strategy in PP_SCHEDULES:
        return float(payload_bytes)
    return payload_bytes * ring_factor(world_size)


def parallel_rows(ranks: list[dict], *, cores: int, workload: dict) -> list[dict]:
    """One row per strategy from the results of every rank of one launch (see parallel_bench)."""
    world_size = len(ranks)
    config = GPTConfig.from_preset(workload["preset"], **workload["config_overrides"])
    shapes = {k: workload[k] for k in ("global_batch", "seq_len", "micro_batches")}
    tokens_per_step = workload["global_batch"] * workload["seq_len"]
    n_params = ranks[0]["n_params"]
    rows = []
    for name in ranks[0]["strategies"]:
        per_rank = [r["strategies"][name] for r in ranks]
        expected = [expected_payload_bytes(name, config, n_params, world_size, rank, **shapes)
                    for rank in range(world_size)]
        measured = [r["payload_bytes"][-1] for r in per_rank]
        timing = Timing(tuple(per_rank[0]["step_samples"]))  # every rank holds the slowest rank's times
        pipeline = name in PP_SCHEDULES
        busiest = max(measured)  # PP's stages differ; DP's and TP's ranks all send the same
        row = {"strategy": name, "world_size": world_size, "threads_per_rank": ranks[0]["threads"],
               "oversubscribed": world_size * ranks[0]["threads"] > cores, "preset": workload["preset"],
               "n_layer": config.n_layer, "n_params": n_params, "global_batch": workload["global_batch"],
               "seq_len": workload["seq_len"],
               "sequences_per_rank": workload["global_batch"] // (world_size if name == "DP" else 1),
               "micro_batches": workload["micro_batches"] if pipeline else None,
               "payload_bytes": busiest, "expected_payload_bytes": max(expected),
               "per_rank_payload_bytes": measured, "per_rank_expected_bytes": expected,
               # every rank, every timed step, to the byte
               "agrees": all(steps == [want] * len(steps) for steps, want in
                             zip((r["payload_bytes"] for r in per_rank), expected)),
               "wire_bytes": ring_wire_bytes(name, busiest, world_size),
               "messages": max(r["calls"][-1] for r in per_rank),
               "ideal_bubble": predicted_bubble_fraction(world_size, workload["micro_batches"]) if pipeline else None,
               "first_loss": per_rank[0]["first_loss"],
               "steps": len(timing.samples), "step_ms": timing.median * 1e3, "step_spread": timing.relative_spread,
               "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / timing.median}
        rows.append(row)
    return add_ratios(rows, "DP", {"speed_vs_dp": "tokens_per_s", "wire_vs_dp": "wire_bytes"})


def _notes(rows: list[dict], workload: dict, cores: int) -> list[str]:
    first = rows[0]
    g, T, m = workload["global_batch"], workload["seq_len"], workload["micro_batches"]
    preset_layers = GPTConfig.from_preset(first["preset"]).n_layer
    layers = ("the preset's own" if preset_layers == first["n_layer"]
              else f"n_layer overridden from the preset's {preset_layers}")
    notes = [
        f"{first['preset']} preset with {first['n_layer']} blocks ({layers}, so that 4 pipeline stages get one "
        f"each; {first['n_params']:,} parameters), fp32 AdamW, one global batch of {g} x {T} tokens "
        f"({g * T:,}) per step for every strategy and world size. DP = torch DDP, each rank {g}/n sequences. "
        "TP = course_lib.tensor_parallel.tp_layers (Megatron from scratch: q/k/v and gate/up split by output, o and down "
        "by input), each rank all the sequences through 1/n of every block's heads and MLP width; embedding, "
        f"norms and lm_head replicated. PP = course_lib.pipeline_parallel.stage, one stage of n_layer/n blocks per rank, {m} "
        f"micro-batches of {g // m} sequences, 1F1B and GPipe schedules. Each strategy trains its own copy of the "
        "same model in the same ranks, one step per round, each right after every other equally often; all start "
        "from the same loss (first_loss in the JSON).",
        "payload = bytes per step this rank hands to all_reduce or send (numel x 4), counted while the step "
        "runs: DP by a DDP communication hook around torch's allreduce_hook (every bucket), TP by the CommStats "
        "of f and g, PP by PipelineRunner.bytes_sent + allreduce_tied_grad. PP's stages differ: the busiest "
        "rank is shown (the JSON has every rank). formula: DP 4 N (the gradient, once); TP L x 4 b s h x 4 "
        "(2 forward + 2 backward all-reduces of the block's (b, s, h) activations per layer, b the whole "
        f"batch); PP {m} micro-batch messages of b/m x s x h x 4 bytes per boundary the stage sends across "
        "(activations right, their gradients left) + the tied embedding's gradient (vocab x h x 4) on the "
        "first and last stage. '=' is yes when every rank's payload equals its formula to the byte in every "
        "timed step.",
        "wire = bytes each rank sends when every all-reduce is a ring, from the measured payload: an all-reduce "
        "of S bytes over n ranks sends 2(n-1)/n x S per rank (reduce-scatter then all-gather; nccl-tests' busbw "
        "factor), so DP and TP wire = payload x 2(n-1)/n; PP's sends go as they are and its tied all-reduce "
        "spans 2 ranks (factor 1), so wire = payload. gloo chooses its own algorithm; a ring (NCCL's ring "
        "algorithm) sends exactly this, the least any all-reduce can send per rank. msgs = all-reduces and "
        "sends per rank per step: DP's buckets (DDP caps the first at 1 MiB), TP's 4 per layer, PP's one per "
        "micro-batch per direction (+1 tied all-reduce).",
        f"step ms = median of {workload['steps']} timed steps (after {workload['warmup']} warm-up) of the "
        "slowest rank, from a barrier through the optimizer step; IQR their spread; tokens/s = tokens per step "
        "/ step ms; speed vs DP = tokens/s / DP's, wire vs DP = wire / DP's, at the same world size. ideal "
        "bubble = (p-1)/(m+p-1), the idle share of a pipeline stage with free communication. Compare times "
        "within a world size only.",
    ]
    return notes + oversubscribed_note(PARALLEL_RANKS, cores, " (TP and PP ranks wait on each other inside every step)")


def run_parallel(opts: Options, strategies=PARALLEL_STRATEGIES) -> Table:
    """DP, TP and PP at 2 and 4 ranks: step time, and bytes per rank measured against the formulas."""
    workload, rows = strategy_rows(parallel_bench, PARALLEL_RANKS, opts, WORKLOAD, strategies, parallel_rows,
                                   log_prefix="bench_parallel_")
    cores = os.cpu_count() or 1
    return Table(
        title="step time and bytes communicated per rank per step: DP, TP, PP (1F1B, GPipe) at 2 and 4 ranks",
        setup=ranks_setup(PARALLEL_RANKS, cores),
        columns=[Column("strategy", "strategy"), Column("world_size", "ranks"),
                 Column("step_ms", "step ms", "{:.1f}"), Column("step_spread", "IQR", "{:.0%}"),
                 Column("tokens_per_s", "tokens/s", "{:,.0f}"), Column("speed_vs_dp", "speed vs DP", "{:.2f}x"),
                 Column("payload_bytes", "payload MB", megabytes("payload_bytes")),
                 Column("expected_payload_bytes", "formula MB", megabytes("expected_payload_bytes")),
                 Column("agrees", "=", agreement("payload_bytes", "expected_payload_bytes")),
                 Column("wire_bytes", "wire MB", megabytes("wire_bytes")),
                 Column("wire_vs_dp", "wire vs DP", "{:.2f}x"), Column("messages", "msgs"),
                 Column("ideal_bubble", "ideal bubble", "{:.0%}")],
        rows=rows, notes=_notes(rows, workload, cores))

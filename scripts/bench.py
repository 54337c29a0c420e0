"""The course's performance figures, measured in one run: `make bench`.

    make bench                                             # every section: ~6 min on a quiet 2-core machine
                                                           # (~1 min more the first time: torch.compile cache)
    .venv/bin/python scripts/bench.py --quick              # smoke run with fewer samples (~2 min)
    .venv/bin/python scripts/bench.py --only matmul,train --json bench.json
    .venv/bin/python scripts/bench.py --list               # the section names

Each table prints the machine line (CPU, cores, how the work was spread: torch threads of one process or
ranks x threads, torch version, load average) next to its figures, and each section its wall time. The
load average is read when the section starts: above the number of cores, other programs compete for the
CPU and the figures drop by far more than their share (the threads of every operator wait for each
other), so measure on a quiet machine; the machine line then says "busy machine".

How the figures are taken is in the modules that take them, one per section in course_tools/bench/: compute
(matmul ceiling, training tokens/s and fraction of the ceiling), profile, attention, comm (all-reduce
bandwidth, data-parallel throughput), sharding (model-state bytes per rank of DDP, ZeRO and FSDP), parallel
(step time and bytes communicated by DP, TP and PP), cp_ep (ring attention and expert parallelism); tables, printing and JSON in course_tools.bench.report.

To add a section: write `run_<name>(opts: Options) -> Table | list[Table]` in a course_tools/bench/<topic>.py
module and add one Section line to SECTIONS below; --only, --list, --quick and --json then cover it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from course_lib.observability.timing import machine_info, setup_threads
from course_tools.bench.attention import run_attention
from course_tools.bench.comm import run_comm
from course_tools.bench.cp_ep import run_context, run_experts
from course_tools.bench.compute import run_matmul, run_train, run_versus
from course_tools.bench.parallel import run_parallel
from course_tools.bench.profile import run_profile
from course_tools.bench.report import Options, Section, as_tables, format_section, section_json
from course_tools.bench.sharding import run_sharding

SECTIONS = [
    Section("matmul", "fp32 (and bf16) square matmul GFLOP/s: the ceiling", run_matmul),
    Section("train", "training tokens/s, model GFLOP/s, fraction of matmul ceiling (tiny, small, medium)",
            run_train),
    Section("vs", "the course GPT's achieved GFLOP/s against a GPT-2 of torch built-ins at equal dims (ratio)",
            run_versus),
    Section("profile", "where a plain eager training step spends its time (GEMM, attention, optimizer, other)",
            run_profile),
    Section("attention", "SDPA vs explicit attention at T=128 and T=512, forward and forward+backward",
            run_attention),
    Section("comm", "all_reduce algbw/busbw (gloo vs ring, 2 and 4 ranks); DDP tokens/s, 1 rank vs 2 ranks",
            run_comm),
    Section("sharding", "model-state bytes per rank, measured and by formula, and step time: DDP, ZeRO-1/2/3, "
            "FSDP at 2 and 4 ranks", run_sharding),
    Section("parallel", "step time and bytes communicated per rank, measured and by formula: DP, TP, PP (1F1B, "
            "GPipe) at 2 and 4 ranks", run_parallel),
    Section("context", "ring attention over one sequence at 1, 2 and 4 ranks: step time, bytes sent per rank against "
            "the formula, work balance of contiguous and zigzag splits", run_context),
    Section("experts", "an expert-parallel MoE layer at 1, 2 and 4 ranks: step time, all-to-all sizes against E x C x d, "
            "bytes to other ranks", run_experts),
]


def select_sections(only: str | None) -> list[Section]:
    """The sections named in a comma-separated list (all of them for None), in SECTIONS order."""
    if only is None:
        return list(SECTIONS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = [s.name for s in SECTIONS]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown section(s) {unknown or [only]}; choose from {known}")
    return [s for s in SECTIONS if s.name in names]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated section names (default: all); see --list")
    parser.add_argument("--quick", action="store_true", help="fewer samples and variants: a fast smoke run")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument("--threads", type=int, help="torch threads (default: the number of cores)")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    args = parser.parse_args(argv)
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:12s} {s.description}")
        return {}
    try:
        sections = select_sections(args.only)
    except ValueError as err:
        parser.error(f"--only: {err}")
    try:
        setup_threads(args.threads)
    except ValueError as err:
        parser.error(f"--threads: {err}")
    opts = Options(quick=args.quick)
    report = {"machine": machine_info(), "argv": sys.argv[1:] if argv is None else list(argv),
              "quick": args.quick, "sections": {}}
    run_start = time.perf_counter()
    for section in sections:
        machine = machine_info()  # the load average when this section started
        start = time.perf_counter()
        tables = as_tables(section.run(opts), section.name)
        wall_s = time.perf_counter() - start
        print("\n" + format_section(section.name, tables, machine, wall_s), flush=True)
        report["sections"][section.name] = section_json(tables, machine, wall_s)
    report["wall_s"] = time.perf_counter() - run_start
    print(f"\ntotal: {report['wall_s']:.0f} s for {len(sections)} section(s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()

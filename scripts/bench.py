"""The course's performance figures, measured in one run: `make bench`.

    make bench                                             # every section: ~1 min on 2 cores (~2 min the
                                                           # first time, while torch.compile fills its cache)
    .venv/bin/python scripts/bench.py --quick              # smoke run with fewer samples (~10-30 s)
    .venv/bin/python scripts/bench.py --only matmul,train --json bench.json
    .venv/bin/python scripts/bench.py --list               # the section names

Each section prints one table with the machine line (CPU, cores, torch threads, torch version) next to
its figures. How the figures are taken:

- one process, torch.set_num_threads(number of cores) (course_lib.timing.setup_threads);
- medians of many samples after warm-up calls that are not timed;
- variants compared in alternation, A B A B ..., in the same run, so that machine noise hits both;
- tokens/s = tokens per optimizer step / median step time; model FLOPs per token = 6N + 12*L*H*Q*T
  (GPT.flops_per_token); achieved GFLOP/s = FLOPs per token * tokens/s / 1e9;
- on a CPU there is no honest datasheet peak, so utilisation is the "fraction of matmul ceiling":
  achieved GFLOP/s / the GFLOP/s of a large fp32 matmul timed in alternation with the training step.
- each table's machine line gives the load average when the section started: above the number of
  cores, other programs compete for the CPU and the figures drop by far more than their share (the
  threads of every operator wait for each other), so measure on a quiet machine.

To add a section, write `run_<name>(opts) -> SectionResult` and append a Section to SECTIONS.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from course_lib.model import GPT, GPTConfig, causal_attention
from course_lib.optim import configure_optimizer
from course_lib.timing import machine_info, machine_line, setup_threads, time_alternating, time_fn


@dataclass
class Options:
    quick: bool
    """Fewer samples and variants: a smoke run that checks every section still works."""


@dataclass
class Column:
    key: str
    header: str
    fmt: str | Callable[[dict], str] = "{}"
    """A format string for row[key], or a function from the whole row to its text."""


@dataclass
class SectionResult:
    title: str
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    setup: str = ""
    """How the work was spread over the machine, e.g. '2 ranks x 1 thread' (default: one process, all cores)."""


@dataclass(frozen=True)
class Section:
    name: str
    description: str
    run: Callable[[Options], SectionResult]


# ----------------------------------------------------------------------------------------------- matmul

MATMUL_CEILING_N = 2048
"""Side of the square fp32 matmul used as the ceiling: large enough that MKL/oneDNN run at full speed."""


def matmul_fn(n: int, dtype: torch.dtype = torch.float32) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    return lambda: a @ b


def matmul_gflops(n: int, seconds: float) -> float:
    return 2 * n**3 / seconds / 1e9


def run_matmul(opts: Options) -> SectionResult:
    """Square matmuls: the fp32 one is the ceiling that the training figures are divided by."""
    cases = [(MATMUL_CEILING_N, torch.float32), (MATMUL_CEILING_N, torch.bfloat16)]
    if not opts.quick:
        cases.insert(1, (4096, torch.float32))
    rows = []
    for n, dtype in cases:
        t = time_fn(matmul_fn(n, dtype), warmup=2, repeats=3 if opts.quick else 8)
        rows.append({"n": n, "dtype": str(dtype).removeprefix("torch."), "time_ms": t.median * 1e3,
                     "gflops": matmul_gflops(n, t.median), "spread": t.relative_spread})
    return SectionResult(
        title="Square matmul C = A @ B, median GFLOP/s = 2 n^3 / time",
        columns=[Column("dtype", "dtype"), Column("n", "n"), Column("time_ms", "median ms", "{:.1f}"),
                 Column("gflops", "GFLOP/s", "{:.1f}"), Column("spread", "IQR/median", "{:.0%}")],
        rows=rows,
        notes=[f"The fp32 n={MATMUL_CEILING_N} matmul is the ceiling of the train section, re-timed there in "
               "alternation with each training step; n=4096 shows that n=2048 is already large enough. The bf16 "
               "matmul is for scale: the train section divides bf16 runs by the fp32 ceiling like every run, "
               "and by the bf16 matmul too."],
    )


# ------------------------------------------------------------------------------------------------ train

@dataclass(frozen=True)
class TrainVariant:
    preset: str
    batch_size: int
    label: str
    bf16_autocast: bool = False
    fused_adamw: bool | None = None
    """None: torch's default AdamW kernel for CPU tensors; True: one fused kernel for every parameter."""
    compile: bool = False
    """torch.compile(model) (inductor): fuses chains of memory-bound operators into single loops."""
    quick: bool = False
    """Also measured by --quick."""

    @property
    def plain(self) -> bool:
        """What a first training loop does: eager, fp32, torch's default AdamW."""
        return not (self.bf16_autocast or self.compile or self.fused_adamw)


# Batch sizes: tokens/s rises with the batch until the activations stop fitting in the caches
# (on 2 cores: tiny flat from B=32 to 256 and lower at 512; small best at B=16, lower at 8 and 32;
# medium flat from B=4). The medium row shows how much of the gap is the small models' own size.
_TINY, _SMALL, _MEDIUM = ("tiny", 128), ("small", 16), ("medium", 4)
TRAIN_VARIANTS = [
    TrainVariant(*_TINY, "eager fp32 (plain)", quick=True),
    TrainVariant(*_TINY, "eager fp32, fused AdamW", fused_adamw=True),
    TrainVariant(*_TINY, "eager bf16 autocast", bf16_autocast=True),
    TrainVariant(*_TINY, "compiled fp32, fused AdamW", fused_adamw=True, compile=True),
    TrainVariant(*_SMALL, "eager fp32 (plain)", quick=True),
    TrainVariant(*_SMALL, "eager fp32, fused AdamW", fused_adamw=True),
    TrainVariant(*_SMALL, "eager bf16 autocast", bf16_autocast=True),
    TrainVariant(*_SMALL, "compiled fp32, fused AdamW", fused_adamw=True, compile=True),
    TrainVariant(*_SMALL, "compiled bf16 autocast, fused AdamW", bf16_autocast=True, fused_adamw=True, compile=True),
    TrainVariant(*_MEDIUM, "eager fp32 (plain)"),
]


def make_train_step(variant: TrainVariant) -> tuple[GPT, Callable[[], None], int, int]:
    """A real optimizer step of the course's GPT on random tokens: (model, step, tokens per step, T).

    Batches are made before timing, so data loading is excluded from the figures.
    """
    torch.manual_seed(0)
    config = GPTConfig.from_preset(variant.preset)
    seq_len = config.block_size
    model = GPT(config)
    optimizer = configure_optimizer(model, lr=3e-4, fused=variant.fused_adamw)
    forward = torch.compile(model) if variant.compile else model
    g = torch.Generator().manual_seed(0)
    batches = itertools.cycle([torch.randint(0, config.vocab_size, (variant.batch_size, seq_len), generator=g)
                               for _ in range(4)])

    def step() -> None:
        idx = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant.bf16_autocast):
            _, loss = forward(idx, targets=idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step, variant.batch_size * seq_len, seq_len


def _best_marker(row: dict) -> str:
    return "<- best" if row["best"] else "<- best fp32" if row["best_fp32"] else ""


def run_train(opts: Options) -> SectionResult:
    """Training tokens/s and model GFLOP/s of the tiny and small presets, as a fraction of the matmul ceiling.

    Why a small model stays below the ceiling even though most of its FLOPs are matmuls (the medium
    preset, n_embd 384 against tiny's 64 and small's 128, is the contrast: plain eager fp32 gets closer):
    - its GEMMs are small: with n_embd 64 or 128 every weight matrix has a short inner dimension, so
      each output element needs few multiply-adds per byte loaded, and fixed per-call costs (packing,
      waking threads, dispatch) are spread over little work;
    - RMSNorm, rotary embeddings, SiLU * up, residual adds, softmax, cross-entropy and the AdamW update
      are memory-bound: a few FLOPs per byte, not counted by 6N + 12LHQT, yet each is a pass over its
      tensors (and autograd adds another pass in backward); the profile section measures their share;
    - hundreds of small operators per step each pay microseconds of Python and dispatcher overhead.
    Larger batches spread the fixed costs until the activations stop fitting in cache; torch.compile
    fuses the memory-bound chains into fewer loops; bf16 autocast speeds up the GEMMs (bf16 matmul is
    faster than fp32 on CPUs with AVX512-BF16/AMX) but adds casts, which the tiny model cannot repay.
    bf16 rows are divided by the fp32 ceiling like every row, and also by a bf16 matmul (last column).
    """
    variants = [v for v in TRAIN_VARIANTS if v.quick or not opts.quick]
    ceilings = {"fp32": matmul_fn(MATMUL_CEILING_N), "bf16": matmul_fn(MATMUL_CEILING_N, torch.bfloat16)}
    rows = []
    for variant in variants:
        model, step, tokens_per_step, seq_len = make_train_step(variant)
        fns = {"step": step, "fp32": ceilings["fp32"]}
        if variant.bf16_autocast:
            fns["bf16"] = ceilings["bf16"]
        # Compilation happens during the warm-up calls. Alternating with the matmul keeps the ratio fair.
        timings = time_alternating(fns, warmup=2 if opts.quick else 3, rounds=3 if opts.quick else 12)
        step_s = timings["step"].median
        tokens_per_s = tokens_per_step / step_s
        flops_per_token = model.flops_per_token(seq_len)
        gflops = flops_per_token * tokens_per_s / 1e9
        ceiling_gflops = matmul_gflops(MATMUL_CEILING_N, timings["fp32"].median)
        row = {"preset": variant.preset, "variant": variant.label, "params": model.num_params(),
               "batch_size": variant.batch_size, "seq_len": seq_len, "tokens_per_step": tokens_per_step,
               "step_ms": step_s * 1e3, "step_spread": timings["step"].relative_spread,
               "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token, "gflops": gflops,
               "matmul_gflops": ceiling_gflops, "fraction": gflops / ceiling_gflops,
               "bf16_autocast": variant.bf16_autocast, "best": False, "best_fp32": False}
        if variant.bf16_autocast:
            row["bf16_matmul_gflops"] = matmul_gflops(MATMUL_CEILING_N, timings["bf16"].median)
            row["fraction_of_bf16_matmul"] = gflops / row["bf16_matmul_gflops"]
        rows.append(row)
    notes = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset]
        plain = mine[0]
        best_fp32 = max((r for r in mine if not r["bf16_autocast"]), key=lambda r: r["fraction"])
        best = max(mine, key=lambda r: r["fraction"])
        best_fp32["best_fp32"] = best["best"] = True
        line = (f"{preset} ({plain['params']:,} parameters, {plain['flops_per_token']:,} FLOPs/token at "
                f"T={plain['seq_len']}): plain eager fp32 reaches {plain['fraction']:.2f} of the matmul ceiling")
        if best_fp32 is not plain:
            line += f"; best fp32: '{best_fp32['variant']}', {best_fp32['fraction']:.2f}"
        if best is not best_fp32:
            line += (f"; best overall: '{best['variant']}', {best['fraction']:.2f} of the fp32 ceiling "
                     f"({best['fraction_of_bf16_matmul']:.2f} of the bf16 matmul)")
        notes.append(line + ".")
    notes.append("One step = forward with targets + backward + AdamW step + zero_grad, on random token batches "
                 f"made beforehand (data loading excluded). ceiling = fp32 {MATMUL_CEILING_N}^3 matmul GFLOP/s, "
                 "timed alternating with each step; IQR = spread of the step times (interquartile range / median).")
    return SectionResult(
        title="Training step of course_lib.model.GPT: tokens/s, model GFLOP/s, fraction of matmul ceiling",
        columns=[Column("preset", "preset"), Column("variant", "variant"), Column("batch_size", "B"),
                 Column("seq_len", "T"), Column("step_ms", "step ms", "{:.1f}"),
                 Column("step_spread", "IQR", "{:.0%}"), Column("tokens_per_s", "tokens/s", "{:,.0f}"),
                 Column("gflops", "GFLOP/s", "{:.1f}"), Column("matmul_gflops", "ceiling", "{:.1f}"),
                 Column("fraction", "fraction", "{:.2f}"),
                 Column("best", "", _best_marker),
                 Column("fraction_of_bf16_matmul", "of bf16 matmul", "{:.2f}")],
        rows=rows, notes=notes)


# ---------------------------------------------------------------------------------------------- profile

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
PROFILE_SHARES = {
    "gemm": "GEMM %",
    "attention": "SDPA kernels %",
    "optimizer": "AdamW + zero_grad %",
    "other_ops": "other ops %",
    "outside_ops": "outside ops %",
}


@contextlib.contextmanager
def _without_profiler_banner():
    """Drop the 'profiler_start/stop' lines the C++ profiler writes to stderr; pass everything else on."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if "SyncActivityProfilerHandler" not in line:
                    sys.stderr.write(line)


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
    with _without_profiler_banner():
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


def run_profile(opts: Options) -> SectionResult:
    """Where one plain eager fp32 training step spends its time (torch.profiler, self time per operator)."""
    rows = []
    for variant in [v for v in TRAIN_VARIANTS if v.plain and (v.quick or not opts.quick)]:
        _, step, _, seq_len = make_train_step(variant)
        for _ in range(2):  # warm-up
            step()
        shares = step_time_shares(step, steps=2 if opts.quick else 5)
        rows.append({"preset": variant.preset, "variant": variant.label, "batch_size": variant.batch_size,
                     "seq_len": seq_len, **{k: 100 * v for k, v in shares.items()}})
    return SectionResult(
        title="Where a training step's time goes (percent of profiled wall time)",
        columns=[Column("preset", "preset"), Column("variant", "variant"), Column("batch_size", "B"),
                 Column("seq_len", "T")] + [Column(k, h, "{:.0f}") for k, h in PROFILE_SHARES.items()],
        rows=rows,
        notes=["GEMM = aten::mm/addmm/bmm (every nn.Linear, forward and backward); other ops = RMSNorm, rotary, "
               "SiLU * up, residual adds, cross-entropy, copies: memory-bound work; outside ops = Python, "
               "autograd and profiler overhead. The FLOPs that 6N + 12LHQT counts are done inside the GEMM and "
               "SDPA kernels; every other microsecond earns none, so the train section's fraction of the matmul "
               "ceiling stays below the GEMM + SDPA share."])


# -------------------------------------------------------------------------------------------- attention

ATTENTION_SHAPE = {"batch": 4, "heads": 12, "head_dim": 64}
"""GPT-2-small's heads (12 x 64); batch 4 keeps the explicit path's T=512 scores at 50 MB."""


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def saved_bytes(fn, *inputs) -> int:
    """Bytes autograd saves for backward when running fn(*inputs), each storage once, inputs excluded."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return total


def run_attention(opts: Options) -> SectionResult:
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
    return SectionResult(
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


# ---------------------------------------------------------------------------------------------- driver

SECTIONS = [
    Section("matmul", "fp32 (and bf16) square matmul GFLOP/s: the ceiling", run_matmul),
    Section("train", "training tokens/s, model GFLOP/s, fraction of matmul ceiling (tiny, small, medium)",
            run_train),
    Section("profile", "where a plain eager training step spends its time (GEMM, attention, optimizer, other)",
            run_profile),
    Section("attention", "SDPA vs explicit attention at T=128 and T=512, forward and forward+backward",
            run_attention),
]


def _cell(row: dict, column: Column) -> str:
    if callable(column.fmt):
        return column.fmt(row)
    value = row.get(column.key)
    return "-" if value is None else column.fmt.format(value)


def format_table(result: SectionResult) -> str:
    cells = [[c.header for c in result.columns]] + [[_cell(r, c) for c in result.columns] for r in result.rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(result.columns))]
    numeric = [all(isinstance(r.get(c.key), (int, float, type(None))) and not isinstance(r.get(c.key), bool)
                   for r in result.rows) for c in result.columns]

    def fmt(line):
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in zip(line, widths, numeric)).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(line) for line in cells[1:]]
    return "\n".join(lines)


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
    for section in sections:
        machine = machine_info()  # the load average when this section started
        start = time.perf_counter()
        result = section.run(opts)
        wall_s = time.perf_counter() - start
        print(f"\n== {section.name}: {result.title}")
        print(f"   machine: {machine_line(machine, result.setup or None)}")
        print(format_table(result))
        for note in result.notes:
            print(textwrap.fill(note, width=110, initial_indent="   ", subsequent_indent="   "))
        print(f"   ({wall_s:.0f} s)", flush=True)
        report["sections"][section.name] = {"title": result.title, "setup": result.setup, "machine": machine,
                                            "rows": result.rows, "notes": result.notes, "wall_s": wall_s}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()

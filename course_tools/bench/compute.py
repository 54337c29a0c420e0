"""Compute sections of `make bench`: the matmul ceiling, and training steps measured against it.

    .venv/bin/python scripts/bench.py --only matmul,train

- one process, torch.set_num_threads(number of cores) (course_lib.observability.timing.setup_threads);
- medians of many samples after warm-up calls that are not timed;
- variants compared in alternation, A B A B ..., in the same run, so that machine noise hits both (the vs
  section, which interleaves six runs of different kinds, changes the order each round so that every run
  follows every other equally often: time_alternating(balanced=True));
- tokens/s = tokens per optimizer step / median step time; model FLOPs per token = 6N + 12*L*H*Q*T
  (GPT.flops_per_token); achieved GFLOP/s = FLOPs per token * tokens/s / 1e9;
- on a CPU there is no honest datasheet peak, so utilisation is the "fraction of matmul ceiling":
  achieved GFLOP/s / the GFLOP/s of a large fp32 matmul timed in alternation with the training step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import course_lib.core.model as model_module
from course_lib.core.fused import rms_norm_reference, rotary_reference, swiglu_reference
from course_lib.core.model import GPT, GPTConfig
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.observability.timing import time_alternating, time_fn
from course_tools.bench.reference_gpt import ReferenceGPT
from course_tools.bench.report import Column, Options, Table

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


def run_matmul(opts: Options) -> Table:
    """Square matmuls: the fp32 one is the ceiling that the training figures are divided by."""
    cases = [(MATMUL_CEILING_N, torch.float32), (MATMUL_CEILING_N, torch.bfloat16)]
    if not opts.quick:
        cases.insert(1, (4096, torch.float32))
    rows = []
    for n, dtype in cases:
        t = time_fn(matmul_fn(n, dtype), warmup=2, repeats=3 if opts.quick else 8)
        rows.append({"n": n, "dtype": str(dtype).removeprefix("torch."), "time_ms": t.median * 1e3,
                     "gflops": matmul_gflops(n, t.median), "spread": t.relative_spread})
    return Table(
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


def variant_train_step(variant: TrainVariant) -> tuple[GPT, Callable[[], None], int, int]:
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
        train_step(forward, [next(batches)], optimizer, amp_dtype=torch.bfloat16 if variant.bf16_autocast else None,
                   grad_norm=False)

    return model, step, variant.batch_size * seq_len, seq_len


def _best_marker(row: dict) -> str:
    return "<- best" if row["best"] else "<- best fp32" if row["best_fp32"] else ""


def run_train(opts: Options) -> Table:
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
        model, step, tokens_per_step, seq_len = variant_train_step(variant)
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
    return Table(
        title="Training step of course_lib.core.model.GPT: tokens/s, model GFLOP/s, fraction of matmul ceiling",
        columns=[Column("preset", "preset"), Column("variant", "variant"), Column("batch_size", "B"),
                 Column("seq_len", "T"), Column("step_ms", "step ms", "{:.1f}"),
                 Column("step_spread", "IQR", "{:.0%}"), Column("tokens_per_s", "tokens/s", "{:,.0f}"),
                 Column("gflops", "GFLOP/s", "{:.1f}"), Column("matmul_gflops", "ceiling", "{:.1f}"),
                 Column("fraction", "fraction", "{:.2f}"),
                 Column("best", "", _best_marker),
                 Column("fraction_of_bf16_matmul", "of bf16 matmul", "{:.2f}")],
        rows=rows, notes=notes)


# ------------------------------------------------------------------------------------------------ versus

def reference_train_step(model, batch_size: int, seq_len: int, vocab_size: int) -> Callable[[], None]:
    """An eager fp32 training step (forward with targets, backward, torch's default AdamW, zero_grad) of `model`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    batches = itertools.cycle([torch.randint(0, vocab_size, (batch_size, seq_len), generator=g) for _ in range(4)])

    def step() -> None:
        train_step(model, [next(batches)], optimizer, grad_norm=False)

    return step


def _with_formulas(step: Callable[[], None], **formulas: Callable) -> Callable[[], None]:
    """step, run with some of course_lib.core.model's fused nodes (rms_norm, rotary, swiglu) swapped for others."""
    def run() -> None:
        saved = {name: getattr(model_module, name) for name in formulas}
        for name, formula in formulas.items():
            setattr(model_module, name, formula)
        try:
            step()
        finally:
            for name, formula in saved.items():
                setattr(model_module, name, formula)

    return run


def layer_norm_kernels(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (torch's native forward and backward kernels) where the course GPT has RMSNorm.

    Not the same function (it subtracts the mean): the vs section times it only to show what RMSNorm costs.
    """
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


def no_rotation(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Queries and keys left as they are (no position information): timed only to show what the rotary
    embedding costs."""
    return q, k


OP_BY_OP = dict(rms_norm=rms_norm_reference, rotary=rotary_reference, swiglu=swiglu_reference)
"""The op-by-op references of course_lib.core.fused, in place of the fused nodes."""
WITHOUT_ROPE_AND_RMSNORM = dict(rms_norm=layer_norm_kernels, rotary=no_rotation)
"""The course GPT without its two element-wise costs that GPT-2 lacks: LayerNorm's kernels for RMSNorm, no
rotary embedding (a cost breakdown, not a model to train)."""


def run_versus(opts: Options) -> Table:
    """The course GPT against a plain GPT-2 of torch built-ins (course_tools.bench.reference_gpt) at equal dims.

    Both train in fp32 with torch's default AdamW, eager and (without --quick) under torch.compile, all
    timed in alternation with the matmul ceiling; the figure of merit is achieved model GFLOP/s,
    6N + 12LHQT per token with each model's own N (their parameter counts differ: SwiGLU against a 4x GELU
    MLP, no biases, no position table). Each ratio compares a row with the GPT-2 of the same mode. Two more
    eager rows show where the course GPT's time goes: the same model with its RMSNorm, rotary embedding and
    SwiGLU op by op (the references of course_lib.core.fused), which shows what the fused nodes buy, and
    with LayerNorm's native kernels for RMSNorm and no rotary embedding, which shows what those two cost.
    """
    config = GPTConfig.from_preset("small")
    batch_size, T = 16, config.block_size
    labels = {"course": "course GPT (RMSNorm, RoPE, SwiGLU, SDPA)",
              "op_by_op": "course GPT, its three formulas op by op",
              "ablated": "course GPT, LayerNorm kernels for RMSNorm and no RoPE (cost breakdown only)",
              "reference": "GPT-2 of torch built-ins (LayerNorm, GELU, SDPA)"}
    formulas = {"op_by_op": OP_BY_OP, "ablated": WITHOUT_ROPE_AND_RMSNORM}
    modes = ["eager"] if opts.quick else ["eager", "compiled"]
    runs, steps = [], {}
    for mode in modes:
        keys = ("course", "op_by_op", "ablated", "reference") if mode == "eager" else ("course", "reference")
        for key in keys:
            torch.manual_seed(0)  # each run trains its own copy of the same initial weights
            model = GPT(config) if key != "reference" else ReferenceGPT(config.vocab_size, T, config.n_layer,
                                                                        config.n_head, config.n_embd)
            forward = torch.compile(model) if mode == "compiled" else model
            name = f"{labels[key]}, {mode}"
            step = reference_train_step(forward, batch_size, T, config.vocab_size)
            steps[name] = _with_formulas(step, **formulas[key]) if key in formulas else step
            runs.append((name, key, mode, model))
    # Balanced turns: the 2048^3 matmul evicts the caches and each run leaves the allocator in its own state,
    # so a run that always came right after the same one would pay for it every round; every run follows
    # every other equally often instead (a Williams design: 2n orders for an odd number n of runs, here
    # 5 runs with --quick and 7 without, once and twice over).
    n_runs = len(steps) + 1
    timings = time_alternating({**steps, "matmul": matmul_fn(MATMUL_CEILING_N)}, warmup=2 if opts.quick else 3,
                               rounds=2 * n_runs if opts.quick else 4 * n_runs, balanced=True)
    ceiling = matmul_gflops(MATMUL_CEILING_N, timings["matmul"].median)
    rows = []
    for name, key, mode, model in runs:
        step_s = timings[name].median
        tokens_per_s = batch_size * T / step_s
        gflops = model.flops_per_token(T) * tokens_per_s / 1e9
        rows.append({"model": labels[key], "mode": mode, "params": model.num_params(),
                     "flops_per_token": model.flops_per_token(T), "step_ms": step_s * 1e3,
                     "step_spread": timings[name].relative_spread, "tokens_per_s": tokens_per_s,
                     "gflops": gflops, "fraction": gflops / ceiling})
    ratios = {}
    for mode in modes:
        same_mode = [r for r in rows if r["mode"] == mode]
        reference_gflops = same_mode[-1]["gflops"]  # the GPT-2 row comes last in each mode
        for row in same_mode:
            row["ratio"] = row["gflops"] / reference_gflops
        ratios[mode] = same_mode[0]["ratio"]
    summary = ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in ratios.items())
    op_by_op, ablated = (next(r["ratio"] for r in rows if r["model"] == labels[key]) for key in ("op_by_op", "ablated"))
    return Table(
        title=f"Course GPT vs a GPT-2 of torch built-ins at equal dims (L{config.n_layer} C{config.n_embd} "
              f"H{config.n_head} T{T} B{batch_size} V{config.vocab_size}), fp32, AdamW",
        columns=[Column("model", "model"), Column("mode", "mode"), Column("params", "params", "{:,}"),
                 Column("flops_per_token", "FLOPs/token", "{:,}"), Column("step_ms", "step ms", "{:.1f}"),
                 Column("step_spread", "IQR", "{:.0%}"), Column("tokens_per_s", "tokens/s", "{:,.0f}"),
                 Column("gflops", "GFLOP/s", "{:.1f}"), Column("fraction", "of ceiling", "{:.2f}"),
                 Column("ratio", "vs GPT-2", "{:.2f}x")],
        rows=rows,
        notes=[f"course GPT / GPT-2 built-ins, achieved model GFLOP/s: {summary} (ceiling: fp32 "
               f"{MATMUL_CEILING_N}^3 matmul, {ceiling:.1f} GFLOP/s, timed in alternation). The course GPT runs "
               "RMSNorm, the rotary embedding and SwiGLU as single autograd nodes with hand-written backward "
               f"passes (course_lib/core/fused.py); with the same formulas op by op it reaches {op_by_op:.2f}x. "
               f"With LayerNorm's native kernels in RMSNorm's place and no rotary embedding it reaches "
               f"{ablated:.2f}x: in eager mode on a CPU those two are what the course GPT pays beyond GPT-2 "
               "(torch has no CPU kernel for RMSNorm's backward; the rotation rewrites every query and key, "
               "forward and backward). Under torch.compile inductor fuses both models' element-wise chains."])

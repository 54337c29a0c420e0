"""Where a training step's time goes: torch.profiler tables and traces, a phase-by-phase split, and MFU.

Three views of the same step, from coarse to fine:

1. `run_step` times the phases of one optimizer step with a wall clock: data, forward, backward,
   communication (the gradient all-reduce, with several ranks) and optimizer. `step_breakdown` takes
   medians over many steps; course_lib.data_parallel.experiment_workers.ddp_step_breakdown is the worker that
   does it on real ranks and also times torch DDP's step, whose all-reduce overlaps the backward.
2. `profile_steps` runs a few steps under torch.profiler: a table of the operators that took the most
   time, a Chrome trace file (open it in chrome://tracing or https://ui.perfetto.dev) in which every
   phase is a named range, and the shares of the time spent in matmuls, attention, the optimizer,
   other operators and outside any operator (Python, dispatch).
3. `measure_throughput` gives tokens/s and model FLOP/s (GPT.flops_per_token), divided on a CPU by a
   large fp32 matmul timed in alternation with the step ("fraction of matmul ceiling") and on a GPU by
   the card's dense bf16 peak (MFU).

    python -m course_lib.observability.profiling                       # tiny preset, 2 threads: all three views
    python -m course_lib.observability.profiling --preset small --out_dir runs/profile
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from course_lib.core.data import RandomBatches, load_tokens, synthetic_tokens
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.observability.timing import machine_line, setup_threads, time_alternating, time_fn
from course_lib.parity import seeded_gpt

PHASES = ("data", "forward", "backward", "communication", "optimizer")
CATEGORIES = ("matmul", "attention", "optimizer", "communication", "other operators", "outside operators")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
MATMUL_CEILING_N = 2048
"""Side of the square fp32 matmul whose FLOP/s is the CPU ceiling (as in scripts/bench.py)."""


@dataclass(frozen=True)
class GpuPeak:
    """One GPU model's dense tensor-core peak (without 2:4 sparsity), as its datasheet gives it."""

    part: str
    tflops: float
    names: tuple[str, ...]
    """Regular expressions, each matched against the whole of a torch.cuda.get_device_name() answer, case ignored,
    after its "NVIDIA " or "Tesla " prefix: exact names, so that no part takes another part's figure."""
    source: str
    """The datasheet the figure comes from (datasheets quote sparse figures: the dense one is half)."""
    dtype: str = "bf16"


_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (BF16 Tensor Core 312 TFLOPS, 624 with sparsity), "
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet, "
         "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_GPU_PEAKS = (
    GpuPeak("A100 SXM4", 312.0, (r"A100-SXM4?-(40|80)GB",), _A100),
    GpuPeak("A100 PCIe", 312.0, (r"A100-PCIE-(40|80)GB", r"A100 (40|80)GB PCIe"), _A100),
    GpuPeak("H100 SXM5", 989.0, (r"H100 80GB HBM3", r"H100 SXM5 80GB"),
            _H100 + " (H100 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity)"),
    GpuPeak("H100 PCIe", 756.0, (r"H100 PCIe", r"H100 80GB PCIe"),
            _H100 + " (H100 PCIe: BF16 Tensor Core 1,513 TFLOPS with sparsity)"),
    GpuPeak("H100 NVL", 835.0, (r"H100 NVL",), _H100 + " (H100 NVL: BF16 Tensor Core 1,671 TFLOPS with sparsity)"),
    GpuPeak("H200 SXM", 989.0, (r"H200",), _H200 + " (H200 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity)"),
    GpuPeak("H200 NVL", 835.0, (r"H200 NVL",), _H200 + " (H200 NVL: BF16 Tensor Core 1,671 TFLOPS with sparsity)"),
    GpuPeak("GH200", 989.0, (r"GH200( .+)?",),
            "NVIDIA GH200 Grace Hopper Superchip datasheet (FP16/BF16 Tensor Core 1,979 TFLOPS with sparsity), "
            "https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip"),
    GpuPeak("B200", 2250.0, (r"B200",),
            "NVIDIA HGX B200 specifications (FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity), "
            "https://www.nvidia.com/en-us/data-center/hgx/"),
    GpuPeak("L40S", 362.0, (r"L40S",), "NVIDIA L40S GPU datasheet (BF16 Tensor Core 362.05 TFLOPS, 733 with sparsity), "
            "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    GpuPeak("L40", 181.0, (r"L40",), "NVIDIA L40 GPU datasheet (BF16 Tensor Core 181.05 TFLOPS, 362.1 with sparsity), "
            "https://images.nvidia.com/content/Solutions/data-center/vgpu-L40-datasheet.pdf"),
    GpuPeak("L4", 121.0, (r"L4",), "NVIDIA L4 Tensor Core GPU datasheet (BF16 Tensor Core 242 TFLOPS with sparsity), "
            "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"),
    GpuPeak("A10", 125.0, (r"A10",), "NVIDIA A10 Tensor Core GPU datasheet (BF16 Tensor Core 125 TFLOPS, 250 with "
            "sparsity), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"),
    GpuPeak("V100 SXM2", 125.0, (r"V100-SXM2-(16|32)GB",),
            "NVIDIA V100 Tensor Core GPU datasheet (Tensor Performance 125 TFLOPS, SXM2), "
            "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
            dtype="fp16"),
    GpuPeak("V100 PCIe", 112.0, (r"V100-PCIE-(16|32)GB",),
            "NVIDIA V100 Tensor Core GPU datasheet (Tensor Performance 112 TFLOPS, PCIe), "
            "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
            dtype="fp16"),
)
GPU_PEAK_TFLOPS: dict[str, GpuPeak] = {peak.part: peak for peak in _GPU_PEAKS}
"""Dense bf16 (V100: fp16) tensor-core peak by exact GPU part, each with its datasheet: gpu_peak() finds a card's
entry from the name torch gives it; an unknown card has none, and its MFU is reported as unknown, not guessed."""


def make_setup(preset: str = "tiny", batch_size: int = 16, *, data_dir: str | None = None, seed: int = 0,
               rank: int = 0, lr: float = 1e-3):
    """(model, optimizer, batches): the course GPT with AdamW, on the corpus (data_dir) or synthetic tokens."""
    model = seeded_gpt(seed, preset)
    tokens = load_tokens("train", data_dir) if data_dir is not None else synthetic_tokens(200_000, seed=seed)
    batches = RandomBatches(tokens, batch_size, model.config.block_size, seed=seed + rank)
    return model, configure_optimizer(model, lr), batches


def _sync(device: torch.device) -> None:
    # A GPU runs kernels asynchronously: without a sync the clock stops when the work is queued, not done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(model, optimizer, batches, *, communicate=None, forward_context=nullcontext) -> dict[str, float]:
    """One optimizer step; returns the seconds of each phase that ran (see PHASES), and "total".

    Each phase is also a profiler range (record_function), so it shows up by name in a trace.
    communicate(): called between backward and the optimizer (e.g. an explicit gradient all-reduce).
    forward_context: wraps forward and backward (e.g. DDP's no_sync, to keep backward free of communication).
    """
    device = next(model.parameters()).device
    times: dict[str, float] = {}

    @contextmanager
    def phase(name):
        with record_function(name):
            start = time.perf_counter()
            yield
            _sync(device)
            times[name] = time.perf_counter() - start

    def forward_backward(micro_batches):
        (idx,) = micro_batches
        with forward_context():
            with phase("forward"):
                _, loss = model(idx, targets=idx)
            with phase("backward"):
                loss.backward()
        return loss.detach()

    optimizer_phase = ExitStack()  # opened once the gradients are ready, closed when the step returns

    def after_backward():
        if communicate is not None:
            with phase("communication"):
                communicate()
        optimizer_phase.enter_context(phase("optimizer"))

    with phase("data"):
        idx = next(batches).to(device)
    with optimizer_phase:
        train_step(model, [idx], optimizer, forward_backward=forward_backward, after_backward=after_backward,
                   grad_norm=False)
    times["total"] = sum(times.values())
    return times


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds of each key over a list of run_step results."""
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def step_breakdown(model, optimizer, batches, *, steps: int = 10, warmup: int = 2) -> dict[str, float]:
    """Median seconds per phase of `steps` steps of one process, after `warmup` untimed steps."""
    for _ in range(warmup):
        run_step(model, optimizer, batches)
    return medians([run_step(model, optimizer, batches) for _ in range(steps)])


def op_category(event) -> str:
    """Which of CATEGORIES a profiler event's self time belongs to (its enclosing optimizer or all-reduce first)."""
    node = event
    while node is not None:  # whatever runs inside the optimizer or the all-reduce belongs to it
        if node.name.startswith(("Optimizer.", "optimizer")):
            return "optimizer"
        if node.name == "communication" or "all_reduce" in node.name or "allreduce" in node.name:
            return "communication"
        node = node.cpu_parent
    if event.name in MATMUL_OPS:
        return "matmul"
    return "attention" if "scaled_dot_product" in event.name else "other operators"


def category_shares(events, wall_us: float) -> dict[str, float]:
    """Fractions of wall_us by CATEGORIES: each operator's self time summed per op_category; "outside operators"
    is the wall time no operator accounts for (Python, autograd bookkeeping, dispatch, the profiler itself)."""
    shares = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if not event.is_user_annotation:  # a range's own time is Python between operators: "outside"
            shares[op_category(event)] += event.self_cpu_time_total
    total_us = max(wall_us, sum(shares.values()))  # clock granularity can make the sum exceed the wall time
    shares["outside operators"] = total_us - sum(shares.values())
    return {name: us / total_us for name, us in shares.items()}


@contextmanager
def without_profiler_banner():
    """Drop the 'profiler_start/stop' lines the C++ profiler writes to file descriptor 2, and the warning of
    torch 2.11 that events are kept for one profiling cycle only (these recordings are one cycle); pass on the rest."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
                yield
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if "SyncActivityProfilerHandler" not in line:
                    sys.stderr.write(line)


@dataclass
class ProfileReport:
    table: str
    """torch.profiler's operator table, sorted by self time."""
    trace_path: Path
    """The Chrome trace (JSON): chrome://tracing or https://ui.perfetto.dev."""
    top_operators: list[dict]
    """{name, calls, self_ms (per step), share} of the operators with the most self time."""
    shares: dict[str, float]
    """Fraction of the profiled wall time by CATEGORIES."""
    steps: int
    wall_s: float


def profile_steps(step_fn, *, steps: int = 3, warmup: int = 2, out_dir=".", trace_name: str = "trace.json",
                  row_limit: int = 12) -> ProfileReport:
    """Call step_fn() `warmup` times, then `steps` times under torch.profiler; write the trace to out_dir."""
    for _ in range(warmup):  # first calls allocate memory and pick kernels: not what a long run looks like
        step_fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with without_profiler_banner():
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step_fn()
        wall_us = (time.perf_counter() - start) * 1e6
    trace_path = Path(out_dir) / trace_name
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    averages = [e for e in prof.key_averages() if not e.is_user_annotation]
    total_self = sum(e.self_cpu_time_total for e in averages) or 1.0
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:row_limit]
    top_operators = [{"name": e.key, "calls": e.count // steps, "self_ms": e.self_cpu_time_total / 1e3 / steps,
                      "share": e.self_cpu_time_total / total_self} for e in top]
    shares = category_shares(prof.events(), wall_us)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
    return ProfileReport(table=table, trace_path=trace_path, top_operators=top_operators,
                         shares=shares, steps=steps, wall_s=wall_us / 1e6)


def gpu_peak(name: str) -> GpuPeak | None:
    """The GPU_PEAK_TFLOPS entry of a device name (torch.cuda.get_device_name), None for a card not in the table.

    Each entry's names must match the whole name, less its "NVIDIA " or "Tesla " prefix: "NVIDIA H100 NVL" is the
    H100 NVL, not the H100 SXM5 whose name also contains "H100", and "NVIDIA A10G" is not the A10."""
    model = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip(), flags=re.IGNORECASE)
    for peak in GPU_PEAK_TFLOPS.values():
        if any(re.fullmatch(pattern, model, flags=re.IGNORECASE) for pattern in peak.names):
            return peak
    return None


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its name (torch.cuda.get_device_name), None if unknown."""
    peak = gpu_peak(name)
    return peak.tflops * 1e12 if peak else None


def peak_text(name: str) -> str:
    """What an MFU is a fraction of: '989 TFLOP/s (H100 SXM5 dense bf16 peak; <datasheet>)', or why there is none."""
    peak = gpu_peak(name)
    if peak is None:
        return f"no peak figure for {name}"
    return f"{peak.tflops:.0f} TFLOP/s ({peak.part} dense {peak.dtype} peak; {peak.source})"


def mfu_text(achieved_flops: float, name: str) -> str:
    """'MFU 47.2% of 989 TFLOP/s (H100 SXM5 dense bf16 peak; <datasheet>)' for a card in GPU_PEAK_TFLOPS, and
    'MFU unknown (no peak figure for <name>)' for any other: a wrong peak would give a wrong MFU."""
    peak = gpu_peak_flops(name)
    if peak is None:
        return f"MFU unknown ({peak_text(name)})"
    return f"MFU {achieved_flops / peak:.1%} of {peak_text(name)}"


def throughput_report(*, tokens_per_step: int, step_s: float, flops_per_token: int, ceiling_flops: float | None,
                      ceiling: str) -> dict:
    """tokens/s = tokens per step / step time; achieved FLOP/s = FLOPs per token x tokens/s; fraction of ceiling."""
    tokens_per_s = tokens_per_step / step_s
    achieved = flops_per_token * tokens_per_s
    return {"tokens_per_step": tokens_per_step, "step_s": step_s, "tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token, "achieved_flops": achieved, "ceiling": ceiling,
            "ceiling_flops": ceiling_flops, "fraction": achieved / ceiling_flops if ceiling_flops else None}


def measure_throughput(model, optimizer, batches, *, rounds: int = 10, warmup: int = 2) -> dict:
    """Tokens/s and model FLOP/s of run_step, as a fraction of a matmul ceiling (CPU) or of the GPU's peak."""
    device = next(model.parameters()).device
    tokens_per_step = batches.batch_size * batches.block_size
    step = lambda: run_step(model, optimizer, batches)  # noqa: E731
    if device.type == "cuda":
        step_s = time_fn(step, warmup=warmup, repeats=rounds, sync=lambda: torch.cuda.synchronize(device)).median
        name = torch.cuda.get_device_name(device)
        ceiling_flops = gpu_peak_flops(name)
        ceiling = (f"{name}: {peak_text(name)} (MFU)" if ceiling_flops else f"MFU unknown ({peak_text(name)})")
    else:
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(MATMUL_CEILING_N, MATMUL_CEILING_N, generator=g) for _ in range(2))
        timings = time_alternating({"step": step, "matmul": lambda: a @ b}, warmup=warmup, rounds=rounds)
        step_s = timings["step"].median
        ceiling_flops = 2 * MATMUL_CEILING_N**3 / timings["matmul"].median
        ceiling = f"fp32 {MATMUL_CEILING_N}^3 matmul, timed in alternation (fraction of matmul ceiling)"
    return throughput_report(tokens_per_step=tokens_per_step, step_s=step_s,
                             flops_per_token=model.flops_per_token(batches.block_size),
                             ceiling_flops=ceiling_flops, ceiling=ceiling)


def format_throughput(t: dict) -> str:
    """One line of a measure_throughput result, naming the ceiling (on a GPU: the peak and its datasheet)."""
    line = f"{t['tokens_per_s']:,.0f} tokens/s, {t['achieved_flops'] / 1e9:.2f} GFLOP/s"
    if t["fraction"] is None:
        return f"{line}; {t['ceiling']}"
    return f"{line} = {t['fraction']:.1%} of {t['ceiling']} ({t['ceiling_flops'] / 1e9:.1f} GFLOP/s)"


def format_breakdown(times: dict[str, float]) -> str:
    """'data 0.1 ms (0%) | forward ...' for the phases present in a run_step / medians result.

    Shares are of the sum of the phases shown (a median of totals is not the sum of the phases' medians)."""
    total = sum(times.get(p, 0.0) for p in PHASES)
    return " | ".join(f"{p} {times[p] * 1e3:.1f} ms ({times[p] / total:.0%})" for p in PHASES if p in times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--out_dir", default="runs/profile", help="where trace.json goes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    print(machine_line())
    model, optimizer, batches = make_setup(args.preset, args.batch_size)
    report = profile_steps(lambda: run_step(model, optimizer, batches), steps=args.steps, out_dir=args.out_dir)
    print(report.table)
    print(f"trace: {report.trace_path} (open in chrome://tracing or https://ui.perfetto.dev)")
    print("time shares: " + ", ".join(f"{k} {v:.0%}" for k, v in report.shares.items()))
    print("phases (median of 10 steps): " + format_breakdown(step_breakdown(model, optimizer, batches)))
    print(format_throughput(measure_throughput(model, optimizer, batches)))


if __name__ == "__main__":
    main()

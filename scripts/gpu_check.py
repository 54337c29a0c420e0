"""`make gpu-check`: everything the course does on a GPU node, checked by one command.

    python scripts/gpu_check.py                       # every step, on CUDA; says so and exits 0 without CUDA
    python scripts/gpu_check.py --steps node,mfu      # some of them
    python scripts/gpu_check.py --steps notebooks --device cpu --only 01_why_distributed   # the runner, on CPU

Steps (each prints its own table; the command exits 1 if any step failed):

- node: driver, CUDA, NCCL, the GPUs, bf16 support and the CPU cores (the checks of the book's CUDA page);
- notebooks: every notebook under papermill with its quick test parameters and device="cuda" where it has a
  `device` parameter (the graded ones from solutions/, whose student versions stop at the first exercise).
  Its table says how each ran ("run as"): cuda in one process; cuda/NCCL when the node has a GPU for each of
  the notebook's ranks; cuda/gloo (COURSE_BACKEND=gloo, ranks on CUDA tensors) when it has fewer; cpu, and
  why: the notebook has no device parameter, or its ranks send tensors to each other, which gloo cannot do
  with CUDA tensors;
- train: `python -m course_lib.train` on one GPU in bf16, then under torchrun on every GPU of the node;
- tests: the `gpu`-marked tests, with every rank's collectives checked for tensors off the rank's device
  (COURSE_DEVICE_GUARD=1, course_lib.runtime.device_guard);
- multigpu: the `multigpu`-marked tests (tests/multigpu: NCCL across the node's GPUs), on a node with two or
  more GPUs; on one with fewer it prints "multigpu: skipped: N GPU(s)";
- mfu: GPT-2 small (124M) trained in bf16 for a few steps: tokens/s, achieved FLOP/s (6N + 12LHQT per token)
  and MFU, the fraction of the card's dense bf16 peak, named with its datasheet
  (course_lib.observability.profiling.GPU_PEAK_TFLOPS; a card not in it gets "MFU unknown"). With --profile,
  the GPU time of three more steps split by kind over every kernel, the matrix products' FLOP/s beside it.

Paths are printed relative to the repository, with <out_dir> for the run's own folder and <tmp> for the
temporary one, so that a saved log names no folder of the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = ("node", "notebooks", "train", "tests", "multigpu", "mfu")
NOTEBOOK_TIMEOUT_S = 900
POINT_TO_POINT = {"session_e/02_pipeline_parallel"}
"""Notebooks whose ranks send tensors to each other (send/recv): gloo cannot send CUDA tensors and NCCL needs one
GPU per rank, so on a node with fewer GPUs than their ranks they run on the CPU, and the table says why."""
RANK_PARAMETERS = re.compile(r"(.*_)?(world_size|world_sizes|ranks)")
"""Parameters that give a notebook's number of ranks (world_size, collective_ranks, failure_world_size, world_sizes)."""


def cuda_summary() -> str:
    """One line: torch, its CUDA, and whether a GPU is visible."""
    return (f"torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}, "
            f"torch.cuda.is_available() = {torch.cuda.is_available()}")


def shown(text: str, out_dir: Path | None = None) -> str:
    """text with the machine's folders replaced: <out_dir> for this run's folder, <tmp> for the temporary folder,
    paths in the repository relative to it, and site-packages/ for the installed packages."""
    if out_dir is not None:
        for form in {str(Path(out_dir).resolve()), str(out_dir)}:
            text = text.replace(form, "<out_dir>")
    text = text.replace(str(REPO_ROOT) + os.sep, "")
    text = re.sub(r"(?:/[^\s'\"/:]+)+/site-packages/", "site-packages/", text)
    for folder, name in ((Path(tempfile.gettempdir()).resolve(), "<tmp>"), (Path(tempfile.gettempdir()), "<tmp>"),
                         (Path.home(), "~")):
        if str(folder) not in ("/", ""):
            text = text.replace(str(folder) + os.sep, name + "/")
    return text


# ------------------------------------------------------------------------------------------ node
def node_check() -> dict:
    """Driver, CUDA, NCCL, GPUs and bf16: what the book's CUDA page checks by hand."""
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    rows = {
        "host": platform.node(),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda,
        "NCCL": ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None,
        "GPUs": torch.cuda.device_count(),
        "CPU cores": os.cpu_count(),
        "nvidia-smi": smi.stdout.strip() if smi.returncode == 0 else f"failed: {smi.stderr.strip()}",
    }
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        rows[f"cuda:{i}"] = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, capability "
                             f"{props.major}.{props.minor}, bf16 {torch.cuda.is_bf16_supported()}")
    rows["bf16 matmul"] = bf16_matmul_tflops()
    for name, value in rows.items():
        print(f"  {name:<12} {value}")
    return rows


def bf16_matmul_tflops(n: int = 8192, repeats: int = 10) -> str:
    """The card's bf16 matrix-product rate on random n x n x n operands: the ceiling that MFU is read against."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        c = a @ b
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    finite = bool(torch.isfinite(c).all())
    return f"{2 * n**3 / seconds / 1e12:.0f} TFLOP/s ({n} x {n} x {n}, mean of {repeats}; finite: {finite})"


# ------------------------------------------------------------------------------------------ notebooks
def notebook_sources(missing: list | None = None) -> list[Path]:
    """Each notebook once: the graded ones from solutions/ (their student versions stop at an exercise).

    Where solutions/ is absent (the learner image of the Dockerfile), graded notebooks are left out and, if
    `missing` is a list, appended to it."""
    sources = []
    for student in sorted((REPO_ROOT / "notebooks").glob("*/*.ipynb")):
        nb = nbformat.read(student, as_version=4)
        graded = any(c.metadata.get("nbgrader", {}).get("grade") for c in nb.cells)
        source = REPO_ROOT / "solutions" / student.parent.name / student.name if graded else student
        if source.is_file():
            sources.append(source)
        elif missing is not None:
            missing.append(student)
    return sources


def parameter_values(nb) -> dict:
    """{name: value} of the parameters cell's assignments, for the values that are Python literals."""
    import ast

    cell = next((c for c in nb.cells if "parameters" in c.metadata.get("tags", [])), None)
    values = {}
    for node in ast.parse(cell.source).body if cell is not None else []:
        if not isinstance(node, ast.Assign):
            continue
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            value = None
        for target in node.targets:
            if isinstance(target, ast.Name):
                values[target.id] = value
            elif isinstance(target, ast.Tuple) and isinstance(value, tuple) and len(value) == len(target.elts):
                values.update({t.id: v for t, v in zip(target.elts, value) if isinstance(t, ast.Name)})
    return values


def parameter_names(nb) -> set[str]:
    return set(parameter_values(nb))


def notebook_ranks(nb, parameters: dict | None = None) -> int:
    """How many ranks a notebook starts at most, from its parameters (with `parameters` overriding them):
    world_size, *_ranks, *_world_size, the largest of world_sizes, and nnodes x nproc_per_node; 0 for none."""
    values = {**parameter_values(nb), **(parameters or {})}
    counts = [0]
    for name, value in values.items():
        if RANK_PARAMETERS.fullmatch(name):
            items = value if isinstance(value, (list, tuple)) else [value]
            counts += [v for v in items if isinstance(v, int) and not isinstance(v, bool)]
    if isinstance(values.get("nnodes"), int) and isinstance(values.get("nproc_per_node"), int):
        counts.append(values["nnodes"] * values["nproc_per_node"])
    return max(counts)


def run_as(name: str, nb, parameters: dict, device: str, gpus: int, backend: str | None = None) -> tuple[str, dict]:
    """How the node runs a notebook: (the table's "run as", the changes to its parameters and environment).

    "cpu (no device parameter)"; "cuda, one process"; "cuda/NCCL" when the node has a GPU for each rank;
    "cuda/gloo (N ranks > M GPU(s))" (COURSE_BACKEND=gloo: NCCL needs one GPU per rank, gloo reduces CUDA tensors
    through host memory); "cpu (send/recv: N ranks > M GPU(s))" for the notebooks of POINT_TO_POINT, whose CUDA
    tensors gloo cannot send. backend: a COURSE_BACKEND set by the caller, which then decides instead.
    """
    if "device" not in parameter_names(nb):
        return "cpu (no device parameter)", {}
    if device != "cuda":
        return f"{device} (--device {device})", {"device": device}
    ranks = notebook_ranks(nb, parameters)
    if ranks == 0:
        return "cuda, one process", {"device": "cuda"}
    if name in POINT_TO_POINT and ranks > gpus:
        return f"cpu (send/recv: {ranks} ranks > {gpus} GPU(s))", {"device": "cpu"}
    if backend:
        return f"cuda/{backend} (COURSE_BACKEND={backend})", {"device": "cuda"}
    if ranks <= gpus:
        return "cuda/NCCL", {"device": "cuda"}
    return f"cuda/gloo ({ranks} ranks > {gpus} GPU(s))", {"device": "cuda", "COURSE_BACKEND": "gloo"}


def _run_notebook(path: Path, device: str, out_dir: Path, env_backend: str | None, deadline: float | None,
                  gpus: int = 0) -> dict:
    """One notebook under papermill (a module-level function, so a process pool can run several at once)."""
    import papermill

    name = f"{path.parent.name}/{path.stem}"
    nb = nbformat.read(path, as_version=4)
    declared = parameter_names(nb)
    parameters = dict(nb.metadata.get("course", {}).get("test_parameters", {}))
    for folder in ("out_dir", "data_dir"):
        if folder in declared:
            parameters[folder] = str(out_dir / path.stem / folder)
    on, changes = run_as(name, nb, parameters, device, gpus, env_backend)
    backend = changes.pop("COURSE_BACKEND", env_backend)
    parameters.update(changes)
    if deadline is not None and time.time() > deadline:
        return {"notebook": name, "seconds": 0.0, "status": "not run (the --time_limit was reached)", "on": on}
    if backend:  # this worker runs one notebook at a time: its environment is the notebook's
        os.environ["COURSE_BACKEND"] = backend
    else:
        os.environ.pop("COURSE_BACKEND", None)
    start = time.perf_counter()
    try:
        papermill.execute_notebook(str(path), str(out_dir / f"{path.stem}.ipynb"), parameters=parameters,
                                   kernel_name="python3", cwd=str(path.parent), progress_bar=False,
                                   execution_timeout=NOTEBOOK_TIMEOUT_S)
        status = "passed"
        detail = ""
    except Exception as err:  # noqa: BLE001 (reported in the table; the step fails at the end)
        status = "FAILED: " + shown((str(err).strip().splitlines() or [type(err).__name__])[-1][:160], out_dir.parent)
        detail = shown(str(err)[-2500:], out_dir.parent)
    return {"notebook": name, "seconds": round(time.perf_counter() - start, 1), "status": status, "on": on,
            "detail": detail}


def notebook_line(row: dict) -> str:
    """One row of the notebooks table: name, seconds, run as, result (scripts/gpu_log.py reads it back)."""
    return f"  {row['notebook']:<44} {row['seconds']:>7.1f} s  {row['on']:<34} {row['status']}"


def run_notebooks(device: str = "cuda", only: list[str] | None = None, out_dir: Path | None = None,
                  jobs: int = 1, time_limit_s: float | None = None) -> list[dict]:
    """Execute each notebook with papermill, its test parameters and `device` where it has that parameter.

    jobs > 1 runs that many notebooks at once (their times then include the sharing of cores and GPU).
    time_limit_s: notebooks not started by then are listed as not run. Returns one row per notebook: name,
    seconds, "passed" or the error's last line, and how it ran (see run_as).
    """
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env_backend = os.environ.get("COURSE_BACKEND")  # set by the caller: it decides for every notebook
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    deadline = time.time() + time_limit_s if time_limit_s else None
    missing = []
    paths = [p for p in notebook_sources(missing) if not only or any(o in f"{p.parent.name}/{p.stem}" for o in only)]
    if missing:
        print(f"  {len(missing)} graded notebook(s) not run: their solutions are not here (solutions/ is in the "
              "instructor image, not the learner's)", flush=True)
    if jobs > 1:
        print(f"  {jobs} notebooks at a time: each time includes sharing the cores and the GPU", flush=True)
    print(f"  {'notebook':<44} {'seconds':>9}  {'run as':<34} result", flush=True)
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_run_notebook, p, device, out_dir, env_backend, deadline, gpus) for p in paths]
        for future in futures:
            rows.append(future.result())
            print(notebook_line(rows[-1]), flush=True)
            if rows[-1].get("detail"):
                print("    " + rows[-1]["detail"].replace("\n", "\n    "), flush=True)
    return rows


# ------------------------------------------------------------------------------------------ training CLI
def train_runs(out_dir: Path) -> list[dict]:
    """The training CLI on one GPU in bf16, then under torchrun on every GPU."""
    common = ["-m", "course_lib.train", "--model_size", "small", "--max_steps", "40", "--batch_size", "16",
              "--precision", "bf16", "--device", "cuda", "--eval_interval", "20", "--no-progress", "--no-tensorboard"]
    gpus = torch.cuda.device_count()
    commands = {
        "one GPU, bf16": [sys.executable, *common, "--out_dir", str(out_dir / "one")],
        f"torchrun, {gpus} GPU(s), bf16": [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
                                           *common, "--strategy", "ddp", "--out_dir", str(out_dir / "ddp")],
    }
    rows = []
    for label, command in commands.items():
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        last = shown((done.stdout.strip().splitlines() or [""])[-1], out_dir.parent)
        status = ("passed" if done.returncode == 0
                  else f"FAILED (exit {done.returncode}): {shown(done.stderr[-2500:], out_dir.parent)}")
        rows.append({"run": label, "seconds": round(time.perf_counter() - start, 1), "status": status, "last": last})
        print(f"  {label:<28} {rows[-1]['seconds']:>7.1f} s  {status}\n    {last}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ gpu tests
def _pytest(marker: str, *paths: str) -> dict:
    """`python -m pytest -m <marker> <paths> -q`, every rank's collectives checked for tensors off its device."""
    env = {**os.environ, "COURSE_DEVICE_GUARD": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, *paths, "-q", "-rA", "-p", "no:cacheprovider"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    for line in done.stdout.splitlines():
        if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR")):
            print(f"    {line}")
    print(f"  pytest -m {marker}: {summary}")
    if done.returncode != 0:
        print(shown(done.stdout[-3000:]))
    return {"returncode": done.returncode, "summary": summary}


def gpu_tests() -> dict:
    return _pytest("gpu")


def multigpu_tests() -> dict:
    """The `multigpu` tests (tests/multigpu) on a node with two or more GPUs; a line saying why not on others.

    No test collected (pytest's exit status 5) counts as a failure: a check that checked nothing has not passed."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"  multigpu: skipped: {gpus} GPU(s)")
        return {"returncode": 0, "skipped": True, "summary": f"skipped: {gpus} GPU(s)"}
    return {**_pytest("multigpu", "tests/multigpu"), "skipped": False}


# ------------------------------------------------------------------------------------------ MFU
SPLIT = ("matrix products", "attention", "cross entropy", "optimizer", "element-wise and other")
"""The kinds of GPU time the --profile split sums every kernel into."""
MATMUL_WORDS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "gemm", "gemv", "mv", "addmv"}
MATMUL_PARTS = ("gemm", "cutlass", "nvjet", "cublas", "xmma")
"""Words of an operator's name, and parts of a kernel's, that mark a matrix product (cuBLAS's nvjet, cutlass and
xmma kernels among them)."""


def name_kind(name: str) -> str | None:
    """The SPLIT kind a single operator or kernel name shows, or None when the name alone does not tell."""
    flat = re.sub(r"[^a-z0-9]", "", name.lower())
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    if name.startswith("Optimizer.") or "adam" in flat:
        return "optimizer"
    if any(part in flat for part in ("scaleddotproduct", "sdpa", "flash", "fmha", "attention")):
        return "attention"
    if any(part in flat for part in ("logsoftmax", "crossentropy", "nllloss")):
        return "cross entropy"
    if words & MATMUL_WORDS or any(part in flat for part in MATMUL_PARTS):
        return "matrix products"
    return None


def row_kind(name: str, context: tuple[str, ...] = ()) -> str:
    """The SPLIT kind of a kernel (or CPU operator) `name` launched inside the operators `context`, innermost first.

    Everything inside the optimizer's step is "optimizer"; otherwise the kernel's own name decides, then the
    operator that launched it, then the ones around that: an unnamed cuBLAS kernel of aten::mm is a matrix product."""
    chain = (name, *context)
    if any(name_kind(n) == "optimizer" for n in chain):
        return "optimizer"
    return next((kind for kind in map(name_kind, chain) if kind), "element-wise and other")


def time_split(rows) -> dict[str, float]:
    """{kind: summed time} over rows of (name, time) or (name, time, context), every SPLIT kind present."""
    split = dict.fromkeys(SPLIT, 0.0)
    for row in rows:
        name, time_us, context = (*row, ())[:3]
        split[row_kind(name, tuple(context))] += time_us
    return split


def profile_rows(prof) -> tuple[str, list[tuple[str, float, tuple[str, ...]]]]:
    """("self CUDA", rows) with one row per GPU kernel when kernels were recorded, each with the operators it ran
    inside; ("self CPU", rows) with one row per CPU operator (its self time) otherwise. No row is left out."""
    from torch.autograd import DeviceType

    events = prof.events()

    def context(event) -> tuple[str, ...]:
        names = []
        while event is not None:
            names.append(event.name)
            event = event.cpu_parent
        return tuple(names)

    operators = {e.id: e for e in events if e.device_type == DeviceType.CPU and not e.linked_correlation_id}
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if kernels:
        return "self CUDA", [(k.name, k.time_range.elapsed_us(), context(operators.get(k.linked_correlation_id)))
                             for k in kernels]
    return "self CPU", [(e.name, e.self_cpu_time_total, context(e.cpu_parent)) for e in events
                        if e.device_type == DeviceType.CPU and not e.is_user_annotation]


def matmul_flops_per_token(model) -> int:
    """FLOPs of a training step's matrix products per token: 6 per weight of every nn.Linear (2 in the forward,
    4 in the backward), each shared weight once (the lm_head is the tied embedding)."""
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return 6 * sum(weights.values())


def format_split(split: dict[str, float], what: str, steps: int, matmul_flops: float | None = None) -> str:
    """The split as lines: each kind's milliseconds and share; the matrix products' implied FLOP/s beside them."""
    total = sum(split.values()) or 1.0
    each = "kernel" if "CUDA" in what else "operator"
    lines = [f"  {what} time of {steps} steps by kind, summed over every {each} ({total / 1e3:.3f} ms in all):"]
    for kind, us in split.items():
        line = f"    {kind:<24} {us / 1e3:>10.3f} ms {us / total:>7.2%}"
        if kind == "matrix products" and matmul_flops and us:
            line += f"   {matmul_flops:.3e} FLOP in {us / 1e3:.3f} ms: {matmul_flops / (us / 1e6) / 1e12:.1f} TFLOP/s"
        lines.append(line)
    return "\n".join(lines)


def mfu_line(params: int, batch: int, seq: int, compiled: bool, card: str, tokens_per_s: float,
             achieved_flops: float) -> str:
    """The MFU step's line: its MFU names the peak and its datasheet, or says it is unknown for this card."""
    from course_lib.observability.profiling import mfu_text

    return (f"  GPT-2 small ({params / 1e6:.0f}M), bf16, batch {batch} x {seq}, "
            f"{'torch.compile' if compiled else 'eager'} on {card}: {tokens_per_s:,.0f} tokens/s, "
            f"{achieved_flops / 1e12:.1f} TFLOP/s achieved, {mfu_text(achieved_flops, card)}")


def gpt2_small_mfu(batch_size: int = 16, steps: int = 10, compile_model: bool = True,
                   profile_to: Path | None = None, out_dir: Path | None = None) -> dict:
    """GPT-2 small in bf16 autocast on cuda:0: tokens/s, achieved FLOP/s and MFU (fraction of the dense bf16 peak).

    profile_to: also profile 3 more steps, print their GPU time split by kind over every kernel (time_split), with
    the FLOP/s of the matrix products, and write that split and the whole operator table to this file.
    """
    from course_lib.core.optim import configure_optimizer
    from course_lib.observability.profiling import gpu_peak, gpu_peak_flops
    from course_lib.parity import seeded_gpt

    device = torch.device("cuda", 0)
    model = seeded_gpt(0, "gpt2-small").to(device)
    optimizer = configure_optimizer(model, 3e-4, fused=True)
    step_model = torch.compile(model) if compile_model else model
    T = model.config.block_size
    idx = torch.randint(0, model.config.vocab_size, (batch_size, T), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(idx, targets=idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compilation and allocator warm-up
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - start) / steps
    name = torch.cuda.get_device_name(device)
    tokens_per_s = batch_size * T / step_s
    achieved = model.flops_per_token(T) * tokens_per_s
    peak, part = gpu_peak_flops(name), gpu_peak(name)
    result = {"card": name, "params": model.num_params(), "batch": batch_size, "seq": T, "compiled": compile_model,
              "step_s": step_s, "tokens_per_s": tokens_per_s, "achieved_tflops": achieved / 1e12,
              "peak_tflops": peak / 1e12 if peak else None, "mfu": achieved / peak if peak else None,
              "peak_part": part.part if part else None, "peak_source": part.source if part else None}
    print(mfu_line(result["params"], batch_size, T, compile_model, name, tokens_per_s, achieved))
    if profile_to is not None:
        from torch.profiler import ProfilerActivity, profile

        from course_lib.observability.profiling import without_profiler_banner

        profiled = 3
        with without_profiler_banner(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                step()
            torch.cuda.synchronize(device)
        what, rows = profile_rows(prof)
        split = time_split(rows)
        matmul_flops = matmul_flops_per_token(model) * batch_size * T * profiled
        text = format_split(split, what, profiled, matmul_flops)
        text += (f"\n    (matrix products: {matmul_flops_per_token(model):,} FLOPs per token x {batch_size * T:,} "
                 f"tokens x {profiled} steps; the whole step: {result['achieved_tflops']:.1f} TFLOP/s)")
        result["split_ms"] = {kind: us / 1e3 for kind, us in split.items()}
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=-1, max_name_column_width=60)
        Path(profile_to).parent.mkdir(parents=True, exist_ok=True)
        Path(profile_to).write_text(text + "\n\nevery operator, by self CUDA time:\n" + table)
        print(f"{text}\n  every operator's row: {shown(str(profile_to), out_dir)}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu runs only the notebooks step, to check the runner itself on a machine without a GPU")
    parser.add_argument("--only", nargs="*", help="notebooks whose name contains one of these")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1)")
    parser.add_argument("--time_limit", type=float, help="seconds after which no further notebook is started")
    parser.add_argument("--mfu_batch", type=int, default=16, help="batch size of the MFU measurement (sequence 1024)")
    parser.add_argument("--profile", action="store_true",
                        help="profile 3 MFU steps: their GPU time by kind over every kernel, and the matmuls' FLOP/s")
    parser.add_argument("--json", type=Path, help="also write every step's results to this file")
    parser.add_argument("--out_dir", type=Path,
                        help="where runs and executed notebooks go (default: a temporary folder)")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown step(s) {unknown}; choose from {list(STEPS)}")
    print(f"make gpu-check: {cuda_summary()}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device on this machine: nothing to check here. Run `make gpu-check` on a GPU node "
              "(`--device cpu --steps notebooks` checks the notebook runner on the CPU).")
        return 0
    if args.device == "cpu" and steps != ["notebooks"]:
        parser.error("--device cpu runs the notebooks step only: pass --steps notebooks")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    results, failed = {}, []
    for step in steps:
        print(f"\n== {step}", flush=True)
        try:
            if step == "node":
                results[step] = node_check()
            elif step == "notebooks":
                results[step] = run_notebooks(args.device, args.only, out_dir / "notebooks", args.jobs, args.time_limit)
                failed += [r["notebook"] for r in results[step] if r["status"] != "passed"]
            elif step == "train":
                results[step] = train_runs(out_dir / "train")
                failed += [r["run"] for r in results[step] if r["status"] != "passed"]
            elif step == "tests":
                results[step] = gpu_tests()
                failed += ["pytest -m gpu"] if results[step]["returncode"] else []
            elif step == "multigpu":
                results[step] = multigpu_tests()
                failed += ["pytest -m multigpu"] if results[step]["returncode"] else []
            elif step == "mfu":
                results[step] = gpt2_small_mfu(args.mfu_batch, out_dir=out_dir,
                                               profile_to=out_dir / "mfu_profile.txt" if args.profile else None)
        except Exception as err:  # noqa: BLE001 (a step that breaks is reported, the others still run)
            print(f"  {step} failed: {type(err).__name__}: {shown(str(err), out_dir)}")
            failed.append(step)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

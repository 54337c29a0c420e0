"""`make gpu-check`: everything the course does on a GPU node, checked by one command.

    python scripts/gpu_check.py                       # every step, on CUDA; says so and exits 0 without CUDA
    python scripts/gpu_check.py --steps node,mfu      # some of them
    python scripts/gpu_check.py --steps notebooks --device cpu --only 01_why_distributed   # the runner, on CPU

Steps (each prints its own table; the command exits 1 if any step failed):

- node: driver, CUDA, NCCL, the GPUs and bf16 support (the checks of the book's CUDA page);
- notebooks: every notebook under papermill with its quick test parameters and device="cuda" where it has a
  `device` parameter (the graded ones from solutions/, whose student versions stop at the first exercise).
  With fewer GPUs than a notebook starts ranks, NCCL (one GPU per rank) cannot run it, so the ranks use gloo on
  the CUDA tensors (COURSE_BACKEND=gloo), which the table says;
- train: `python -m course_lib.train` on one GPU in bf16, then under torchrun on every GPU of the node;
- tests: the `gpu`-marked tests, with every rank's collectives checked for tensors off the rank's device
  (COURSE_DEVICE_GUARD=1, course_lib.runtime.device_guard);
- mfu: GPT-2 small (124M) trained in bf16 for a few steps: tokens/s, achieved FLOP/s (6N + 12LHQT per token)
  and MFU, the fraction of the card's dense bf16 peak (course_lib.observability.profiling.GPU_PEAK_TFLOPS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = ("node", "notebooks", "train", "tests", "mfu")
NOTEBOOK_TIMEOUT_S = 900
POINT_TO_POINT = {"session_e/02_pipeline_parallel": 2}
"""Notebooks whose ranks send tensors to each other (send/recv), with their number of ranks: gloo cannot send CUDA
tensors and NCCL needs one GPU per rank, so on a node with fewer GPUs they run on the CPU, and the table says why."""


def cuda_summary() -> str:
    """One line: torch, its CUDA, and whether a GPU is visible."""
    return (f"torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}, "
            f"torch.cuda.is_available() = {torch.cuda.is_available()}")


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
def notebook_sources() -> list[Path]:
    """Each notebook once: the graded ones from solutions/ (their student versions stop at an exercise)."""
    sources = []
    for student in sorted((REPO_ROOT / "notebooks").glob("*/*.ipynb")):
        nb = nbformat.read(student, as_version=4)
        graded = any(c.metadata.get("nbgrader", {}).get("grade") for c in nb.cells)
        sources.append(REPO_ROOT / "solutions" / student.parent.name / student.name if graded else student)
    return sources


def parameter_names(nb) -> set[str]:
    import ast

    cell = next((c for c in nb.cells if "parameters" in c.metadata.get("tags", [])), None)
    if cell is None:
        return set()
    return {t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def _run_notebook(path: Path, device: str, out_dir: Path, env_backend: str | None, deadline: float | None) -> dict:
    """One notebook under papermill (a module-level function, so a process pool can run several at once)."""
    import papermill

    name = f"{path.parent.name}/{path.stem}"
    nb = nbformat.read(path, as_version=4)
    declared = parameter_names(nb)
    parameters = dict(nb.metadata.get("course", {}).get("test_parameters", {}))
    for folder in ("out_dir", "data_dir"):
        if folder in declared:
            parameters[folder] = str(out_dir / path.stem / folder)
    on = "CPU (no device parameter)"
    if "device" in declared:
        parameters["device"] = device
        on = device + (f" (ranks on {env_backend})" if env_backend else "")
        ranks = POINT_TO_POINT.get(name, 0)
        if device == "cuda" and torch.cuda.device_count() < ranks:
            parameters["device"] = "cpu"
            on = f"cpu: send/recv, {ranks} ranks > {torch.cuda.device_count()} GPU(s)"
    if deadline is not None and time.time() > deadline:
        return {"notebook": name, "seconds": 0.0, "status": "not run (the --time_limit was reached)", "on": on}
    start = time.perf_counter()
    try:
        papermill.execute_notebook(str(path), str(out_dir / f"{path.stem}.ipynb"), parameters=parameters,
                                   kernel_name="python3", cwd=str(path.parent), progress_bar=False,
                                   execution_timeout=NOTEBOOK_TIMEOUT_S)
        status = "passed"
        detail = ""
    except Exception as err:  # noqa: BLE001 (reported in the table; the step fails at the end)
        status = "FAILED: " + (str(err).strip().splitlines() or [type(err).__name__])[-1][:160]
        detail = str(err)[-2500:]
    return {"notebook": name, "seconds": round(time.perf_counter() - start, 1), "status": status, "on": on,
            "detail": detail}


def run_notebooks(device: str = "cuda", only: list[str] | None = None, out_dir: Path | None = None,
                  jobs: int = 1, time_limit_s: float | None = None) -> list[dict]:
    """Execute each notebook with papermill, its test parameters and `device` where it has that parameter.

    jobs > 1 runs that many notebooks at once (their times then include the sharing of cores and GPU).
    time_limit_s: notebooks not started by then are listed as not run. Returns one row per notebook: name,
    seconds, "passed" or the error's last line, and what device it ran on.
    """
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env_backend = None
    if device == "cuda" and torch.cuda.device_count() < 4:  # the notebooks start up to 4 ranks
        env_backend = os.environ.setdefault("COURSE_BACKEND", "gloo")
    deadline = time.time() + time_limit_s if time_limit_s else None
    paths = [p for p in notebook_sources() if not only or any(o in f"{p.parent.name}/{p.stem}" for o in only)]
    if jobs > 1:
        print(f"  {jobs} notebooks at a time: each time includes sharing the cores and the GPU", flush=True)
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_run_notebook, p, device, out_dir, env_backend, deadline) for p in paths]
        for future in futures:
            rows.append(future.result())
            print(f"  {rows[-1]['notebook']:<44} {rows[-1]['seconds']:>7.1f} s  {rows[-1]['on']:<28} "
                  f"{rows[-1]['status']}", flush=True)
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
        last = (done.stdout.strip().splitlines() or [""])[-1]
        status = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode}): {done.stderr[-2500:]}"
        rows.append({"run": label, "seconds": round(time.perf_counter() - start, 1), "status": status, "last": last})
        print(f"  {label:<28} {rows[-1]['seconds']:>7.1f} s  {status}\n    {last}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ gpu tests
def gpu_tests() -> dict:
    env = {**os.environ, "COURSE_DEVICE_GUARD": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-m", "gpu", "-p", "no:cacheprovider"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    for line in done.stdout.splitlines():
        if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR")):
            print(f"    {line}")
    print(f"  pytest -m gpu: {summary}")
    if done.returncode != 0:
        print(done.stdout[-3000:])
    return {"returncode": done.returncode, "summary": summary}


# ------------------------------------------------------------------------------------------ MFU
def gpt2_small_mfu(batch_size: int = 16, steps: int = 10, compile_model: bool = True,
                   profile_to: Path | None = None) -> dict:
    """GPT-2 small in bf16 autocast on cuda:0: tokens/s, achieved FLOP/s and MFU (fraction of the dense bf16 peak).

    profile_to: also profile 3 more steps and write (and print) the operators that took the most GPU time.
    """
    from course_lib.core.optim import configure_optimizer
    from course_lib.observability.profiling import gpu_peak_flops
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
    peak = gpu_peak_flops(name)
    result = {"card": name, "params": model.num_params(), "batch": batch_size, "seq": T, "compiled": compile_model,
              "step_s": step_s, "tokens_per_s": tokens_per_s, "achieved_tflops": achieved / 1e12,
              "peak_tflops": peak / 1e12 if peak else None, "mfu": achieved / peak if peak else None}
    mfu = f"{result['mfu']:.1%} of {result['peak_tflops']:.0f} TFLOP/s" if peak else "peak unknown for this card"
    print(f"  GPT-2 small ({result['params'] / 1e6:.0f}M), bf16, batch {batch_size} x {T}, "
          f"{'torch.compile' if compile_model else 'eager'} on {name}: {tokens_per_s:,.0f} tokens/s, "
          f"{result['achieved_tflops']:.1f} TFLOP/s achieved, MFU {mfu}")
    if profile_to is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        Path(profile_to).parent.mkdir(parents=True, exist_ok=True)
        Path(profile_to).write_text(table)
        print(f"  the operators with the most GPU time over 3 steps ({profile_to}):\n{table}")
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
    parser.add_argument("--profile", action="store_true", help="profile the MFU steps and print the top operators")
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
            elif step == "mfu":
                results[step] = gpt2_small_mfu(args.mfu_batch,
                                               profile_to=out_dir / "mfu_profile.txt" if args.profile else None)
        except Exception as err:  # noqa: BLE001 (a step that breaks is reported, the others still run)
            print(f"  {step} failed: {type(err).__name__}: {err}")
            failed.append(step)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

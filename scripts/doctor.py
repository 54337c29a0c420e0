"""What this machine is, what the course will do on it, and what is wrong: one line per fact or check.

    make doctor                        # with .venv's Python, or the one make would create .venv with
    .venv/bin/python scripts/doctor.py

Each line reads `<status> <name>: <value>`: "ok" for a check that passed, "—" for a fact or a check that does
not apply here (no NVIDIA GPU on a laptop), "FAIL" for something to fix, with what to do. First the machine
(platform, Python, torch and its builds, the devices), then the choices the course's code makes on it (device,
distributed backend, how the launcher starts processes, the network variables it reads), then the checks of
book/gpu_node.md, "Prepare the environment". Nothing here raises: a failure is a line. The exit code is 1 when
a line says FAIL, 0 otherwise (on a laptop without a GPU, too).

Written for old Pythons as well, so that it can say why one is too old.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MIN_PYTHON = (3, 10)
INSTALL_PYTHON = ("install Python 3.12: the installer from https://www.python.org/downloads/, "
                  "`brew install python@3.12` or `uv python install 3.12`; then make venv PYTHON=python3.12")
OK, INFO, FAIL = "ok", "—", "FAIL"


class Report:
    def __init__(self):
        self.failed = 0

    def line(self, status: str, name: str, value) -> None:
        self.failed += status == FAIL
        print(f"{status:<4} {name}: {value}", flush=True)

    def check(self, name: str, compute) -> None:
        """compute() returns (status, value) or None (no line); an exception becomes a FAIL line."""
        try:
            found = compute()
        except Exception as err:  # noqa: BLE001 (the point: every failure is a line, never a traceback)
            found = FAIL, f"{type(err).__name__}: {err}".strip().splitlines()[0][:300]
        if found is not None:
            status, value = found
            self.line(status, name, value)


def run(command: list[str], timeout: float = 20.0) -> subprocess.CompletedProcess | None:
    """The command's result, or None when it is not installed or does not answer."""
    if shutil.which(command[0]) is None:
        return None
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None


# -------------------------------------------------------------------------------------------- the machine
def platform_line():
    system, machine = platform.system(), platform.machine()
    if system == "Darwin":
        mac = platform.mac_ver()[0] or "?"
        return INFO, f"macOS {mac} (Darwin {platform.release()}), {machine}"
    if system == "Linux":
        distro = ""
        try:
            fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
            distro = fields.get("PRETTY_NAME", "").strip('"')
        except OSError:
            pass
        return INFO, f"Linux {platform.release()}, {machine}" + (f" ({distro})" if distro else "")
    return INFO, f"{system} {platform.release()}, {machine}"


def rosetta_line():
    """An x86_64 Python on an Apple-silicon Mac runs translated: slow, no MPS, and no torch wheels for it."""
    if platform.system() != "Darwin":
        return None
    done = run(["sysctl", "-n", "sysctl.proc_translated"])
    if done is not None and done.stdout.strip() == "1":
        return FAIL, (f"this Python ({platform.machine()}) runs under Rosetta on Apple silicon: no torch wheels "
                      f"and no MPS for it; {INSTALL_PYTHON}")
    return OK, f"native {platform.machine()} Python"


def python_line():
    version = platform.python_version()
    where = sys.executable
    if sys.version_info[:2] < MIN_PYTHON:
        return FAIL, f"{version} ({where}) is older than 3.10, which the course needs: {INSTALL_PYTHON}"
    return OK, f"{version} ({where})"


def environment_line():
    if sys.prefix != getattr(sys, "base_prefix", sys.prefix):
        return INFO, f"virtual environment {sys.prefix}"
    if os.environ.get("CONDA_PREFIX") and Path(sys.prefix).resolve() == Path(os.environ["CONDA_PREFIX"]).resolve():
        return INFO, f"conda environment {sys.prefix}"
    return INFO, f"no virtual environment ({sys.prefix}): `make venv` creates .venv"


def import_torch():
    try:
        import torch
    except ImportError as err:
        return None, err
    return torch, None


def torch_line(torch, err):
    if torch is None:
        return FAIL, f"not importable in this Python ({err}): run `make venv`, then `make doctor` again"
    builds = []
    builds.append(f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build, no CUDA")
    if getattr(torch.version, "hip", None):
        builds.append(f"ROCm {torch.version.hip}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_built():
        builds.append("MPS built")
    return OK, f"{torch.__version__} ({', '.join(builds)})"


def cuda_devices_line(torch):
    if not torch.cuda.is_available():
        return INFO, "none"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return OK, f"{len(names)}: " + ", ".join(names)


def mps_line(torch):
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_built():
        return INFO, "not in this torch build" if platform.system() == "Darwin" else "no (not a Mac)"
    return (OK, "available (Apple GPU)") if mps.is_available() else (INFO, "built, but not available here")


def deepspeed_line():
    try:
        from importlib import metadata
        return OK, f"{metadata.version('deepspeed')} (installed)"
    except Exception:  # noqa: BLE001 (PackageNotFoundError, or no importlib.metadata on a very old Python)
        return INFO, "not installed (optional: make venv EXTRAS=deepspeed; a laptop does not need it)"


# ------------------------------------------------------------------------------- the course's choices
def course_lines(report: Report, torch) -> None:
    try:
        import course_lib
        from course_lib.core.device import select_device
        from course_lib.runtime import env
    except Exception as err:  # noqa: BLE001 (a Python too old for its syntax included)
        report.line(FAIL, "course_lib", f"not importable ({type(err).__name__}: {err}): run `make venv`")
        return
    report.line(OK, "course_lib", str(Path(course_lib.__file__).parent))

    def single_process():
        device = select_device("auto")
        note = {"mps": "the Apple GPU", "cuda": "the NVIDIA GPU", "cpu": "the CPU"}.get(device.type, device.type)
        return INFO, f"{device} ({note}): one process with device=\"auto\""

    def distributed():
        device = env.rank_device(0, "auto", 1)
        backend = os.environ.get(env.BACKEND_VARIABLE) or env.default_backend(device)
        chosen = f" ({env.BACKEND_VARIABLE} set)" if os.environ.get(env.BACKEND_VARIABLE) else ""
        return INFO, f"{backend}{chosen}: ranks on {device.type}"

    def start_method():
        from course_lib.runtime.launch import START_METHOD_VARIABLE, _start_method
        method = _start_method()  # raises ValueError for a bad COURSE_LAUNCH_START_METHOD
        chosen = f" ({START_METHOD_VARIABLE} set)" if os.environ.get(START_METHOD_VARIABLE) else ""
        return INFO, f"{method}{chosen}: how the course's launcher starts its rank processes"

    report.check("device", single_process)
    report.check("distributed backend", distributed)
    report.check("start method", start_method)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "COURSE_OUTPUT_ROOT"):
        if os.environ.get(name):
            report.line(INFO, name, os.environ[name])


# ------------------------------------------------------------------ book/gpu_node.md: check the node
def node_lines(report: Report, torch) -> None:
    smi = run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    driver = smi is not None and smi.returncode == 0
    if smi is None:
        report.line(INFO, "nvidia-smi", "not found: no NVIDIA driver on this machine")
    elif not driver:
        report.line(FAIL, "nvidia-smi", f"fails ({(smi.stderr or smi.stdout).strip()[:200]}): the driver is broken "
                                        "or the job has no GPU allocated")
    else:
        report.line(OK, "nvidia-smi", "; ".join(smi.stdout.strip().splitlines()))
    if torch is None:
        return

    def cuda_build():
        if torch.version.cuda:
            return OK, torch.version.cuda
        if driver:
            return FAIL, ("None: the CPU build of torch on a machine with an NVIDIA GPU; install the CUDA build "
                          "(book/setup.md, \"On a machine with an NVIDIA GPU\")")
        return INFO, "None (the CPU build)"

    def available():
        yes = torch.cuda.is_available()
        if yes:
            return OK, "True"
        if driver and torch.version.cuda:
            return FAIL, ("False although nvidia-smi sees a GPU: the driver may be older than CUDA "
                          f"{torch.version.cuda} needs, or CUDA_VISIBLE_DEVICES hides the GPUs")
        return INFO, "False"

    def count():
        n = torch.cuda.device_count()
        return (OK if n else INFO), str(n)

    def bf16():
        if not torch.cuda.is_available():
            return INFO, "no CUDA device"
        return (OK, "True") if torch.cuda.is_bf16_supported() else (INFO, "False (fp16 with a GradScaler instead)")

    def nccl():
        if not torch.cuda.is_available():
            return INFO, "no CUDA device"
        if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
            return FAIL, "this torch build has no NCCL: multi-GPU runs cannot use it"
        return OK, ".".join(map(str, torch.cuda.nccl.version()))

    report.check("torch.version.cuda", cuda_build)
    report.check("cuda available", available)
    report.check("device count", count)
    report.check("bf16 supported", bf16)
    report.check("NCCL version", nccl)


def main() -> int:
    try:
        sys.stdout.reconfigure(errors="replace")  # an ASCII terminal shows "?" for "—" instead of failing
    except (AttributeError, ValueError):
        pass
    report = Report()
    report.check("platform", platform_line)
    report.check("architecture", rosetta_line)
    report.check("python", python_line)
    report.check("environment", environment_line)
    torch, err = import_torch()
    report.check("torch", lambda: torch_line(torch, err))
    if torch is not None:
        report.check("cuda devices", lambda: cuda_devices_line(torch))
        report.check("mps", lambda: mps_line(torch))
    report.check("deepspeed", deepspeed_line)
    if torch is not None:
        course_lines(report, torch)
    node_lines(report, torch)
    print(f"{report.failed} check(s) failed" if report.failed else "no check failed", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `make doctor | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)

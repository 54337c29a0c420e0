"""Installing the course: the Makefile's choice of Python, the optional DeepSpeed extra, the offline wheelhouse and
`make doctor`.

    .venv/bin/python -m pytest -q tests/test_install.py
    COURSE_TEST_WHEELHOUSE=1 .venv/bin/python -m pytest -q tests/test_install.py -k full -s    # opt-in, minutes

Every `make` here runs with VENV pointing into a temporary folder (and most with -n, which prints the commands
instead of running them), so the repository's .venv is never touched.

- Python: a candidate older than 3.10 is refused, the first one that is new enough creates the venv, and none
  stops make with one line that says what to install.
- DeepSpeed: the course's library and training CLI import and start without it.
- Offline: `make wheelhouse` fills a folder from which `pip install --no-index --find-links <folder>` resolves
  the requirements with pip's configuration shut off (no index, no find-links of this machine); the opt-in test
  does it for the whole of requirements.txt.
- `make doctor`: one `ok/—/FAIL name: value` line per fact or check, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[1]
NETWORK_ERRORS = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
                            r"resolution|Name or service not known|Network is unreachable|ConnectTimeout|"
                            r"ReadTimeout|ProxyError|Could not fetch URL|No route to host")
STATUS_LINE = re.compile(r"^(ok|—|FAIL) +([^:]+): (.+)$")


def make(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in (env or os.environ).items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO_ROOT), *args], env=environ,
                          capture_output=True, text=True, timeout=timeout)


def fake_python(folder: Path, name: str, version: str) -> Path:
    """A script that answers every question with one version number, as an old interpreter would."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def isolated_pip_env() -> dict:
    """This environment without any of pip's configuration: no config file, no PIP_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")


# ------------------------------------------------------------------------------------------------ Python
def test_make_refuses_a_python_older_than_3_10_in_one_line_that_says_what_to_install(tmp_path):
    old = fake_python(tmp_path / "bin", "python3", "3.9.18")
    done = make("-n", "venv", f"PYTHON={old}", f"VENV={tmp_path / 'venv'}")
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    (line,) = lines
    assert "Python 3.10 or newer" in line and str(old) in line
    for way in ("https://www.python.org/downloads/", "brew install python@3.12", "uv python install 3.12"):
        assert way in line
    assert not (tmp_path / "venv").exists()


def test_make_takes_the_first_candidate_that_is_3_10_or_newer(tmp_path):
    """python3.13 is tried first; one that reports 3.9 is passed over for python3.12."""
    fake_python(tmp_path / "bin", "python3.13", "3.9.18")
    (tmp_path / "bin" / "python3.12").symlink_to(sys.executable)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    done = make("-n", "venv", f"VENV={tmp_path / 'venv'}", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"python3.12 -m venv {tmp_path / 'venv'}"
    assert "make venv EXTRAS=deepspeed" not in done.stdout and "requirements-deepspeed.txt" not in done.stdout


def test_make_venv_installs_from_a_wheelhouse_alone_and_adds_extras_against_the_pins(tmp_path):
    wheelhouse = tmp_path / "wheels"
    done = make("-n", "venv", f"PYTHON={sys.executable}", f"VENV={tmp_path / 'venv'}", f"WHEELHOUSE={wheelhouse}",
                "EXTRAS=deepspeed")
    assert done.returncode == 0, done.stdout + done.stderr
    installs = [line for line in done.stdout.splitlines() if " -m pip install " in line]
    assert len(installs) == 3, installs  # requirements.txt, course_lib, the extra
    for line in installs:
        assert f"--no-index --find-links {wheelhouse}" in line, line
    assert "-r requirements.txt" in installs[0] and "-e ." in installs[1]
    assert "-r requirements-deepspeed.txt -c requirements.txt" in installs[2]
    assert done.stdout.rstrip().splitlines()[-1] == f"touch {tmp_path / 'venv'}/.installed-deepspeed"


def test_make_help_lists_doctor_and_wheelhouse():
    done = make("help")
    targets = {line.split()[0] for line in done.stdout.splitlines()[1:]}
    assert {"venv", "doctor", "wheelhouse", "gpu-check"} <= targets


# --------------------------------------------------------------------------------------------- DeepSpeed
HIDE_DEEPSPEED = """
import importlib.machinery, importlib.util, sys

class WithoutDeepSpeed(importlib.machinery.PathFinder):  # as if it were not installed: find_spec finds nothing
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [WithoutDeepSpeed if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
assert importlib.util.find_spec("deepspeed") is None
try:
    import deepspeed
except ModuleNotFoundError:
    print("deepspeed: not importable")
"""


def test_the_course_imports_and_its_training_cli_starts_without_deepspeed():
    code = HIDE_DEEPSPEED + """
import runpy
import course_lib, course_lib.train, course_lib.integrations, course_lib.integrations.deepspeed_train
print("course_lib imported")
sys.argv = ["course_lib.train", "--help"]
try:
    runpy.run_module("course_lib.train", run_name="__main__", alter_sys=True)   # python -m course_lib.train --help
except SystemExit as exit:
    print("exit", exit.code)
import contextlib, io
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        course_lib.integrations.deepspeed_train.main(["--deepspeed_config", "config/deepspeed_zero2.json"])
    except SystemExit as exit:
        print("deepspeed entry exit", exit.code, err.getvalue().strip())
print("deepspeed imported:", "deepspeed" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "deepspeed: not importable" and "course_lib imported" in lines
    assert any(line.startswith("usage:") for line in lines) and "exit 0" in lines
    assert lines[-1] == "deepspeed imported: False"
    entry = next(line for line in lines if line.startswith("deepspeed entry exit"))  # one line, no traceback
    assert entry.startswith("deepspeed entry exit 2 ") and "make venv EXTRAS=deepspeed" in entry, entry


# --------------------------------------------------------------------------------------------- offline
def test_make_wheelhouse_plans_the_target_platforms_wheels_and_builds_deepspeed(tmp_path):
    """What `make wheelhouse` runs for an x86_64 cluster node, read with -n (nothing is downloaded)."""
    wheelhouse = tmp_path / "wheels"
    done = make("-n", "wheelhouse", f"WHEELHOUSE={wheelhouse}", "PLATFORM=manylinux_2_28_x86_64",
                "PYTHON_VERSION=3.11", "EXTRAS=deepspeed", f"PYTHON={sys.executable}", f"VENV={tmp_path / 'venv'}")
    assert done.returncode == 0, done.stdout + done.stderr
    downloads = [line for line in done.stdout.splitlines() if " -m pip download " in line]
    assert len(downloads) == 2, done.stdout  # torch from its CUDA index, then everything else
    torch_pin = next(line.split("==")[1] for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
                     if line.startswith("torch=="))
    assert f'"torch=={torch_pin}" --index-url https://download.pytorch.org/whl/cu128' in downloads[0]
    for line in downloads:
        assert "--only-binary=:all:" in line and "--python-version 3.11" in line and f"--dest {wheelhouse}" in line
        platforms = re.findall(r"--platform (\S+)", line)
        # the target's tag and every older glibc's: most wheels are built for manylinux2014 (glibc 2.17)
        assert platforms[0] == "manylinux_2_28_x86_64"
        assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(platforms)
        assert not [tag for tag in platforms if not tag.endswith("_x86_64")]
    assert "-r requirements.txt" in done.stdout and "-r requirements-deepspeed.txt" in done.stdout
    assert '"setuptools>=64"' in done.stdout  # pip needs it to install course_lib (-e .) without an index
    (build,) = [line for line in done.stdout.splitlines() if " -m pip wheel " in line]
    assert "--no-deps" in build and "-r requirements-deepspeed.txt" in build  # source only: built here


def fill_wheelhouse(tmp_path: Path, requirements: Path, *extra: str, timeout: float) -> tuple[Path, float, str]:
    wheelhouse = tmp_path / "wheelhouse"
    start = time.perf_counter()
    done = make("wheelhouse", f"WHEELHOUSE={wheelhouse}", f"REQUIREMENTS={requirements}", f"PYTHON={sys.executable}",
                f"VENV={tmp_path / 'no-venv'}", *extra, timeout=timeout,
                env=dict(os.environ, PIP_DEFAULT_TIMEOUT="20", PIP_RETRIES="1"))
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != 0 and NETWORK_ERRORS.search(output):
        pytest.skip(f"downloading the wheels needs the network, which is unreachable here: "
                    f"{NETWORK_ERRORS.search(output).group(0)}")
    assert done.returncode == 0, output
    return wheelhouse, seconds, output


def resolve_offline(tmp_path: Path, wheelhouse: Path, requirements: Path) -> dict[str, dict]:
    """`pip install --dry-run --no-index --find-links <wheelhouse>` with pip's configuration shut off:
    {package: what pip would install}, each from the wheelhouse."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
                           "--find-links", str(wheelhouse), "-r", str(requirements), "--report", str(report),
                           "--quiet"], env=isolated_pip_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    chosen = {}
    for item in json.loads(report.read_text())["install"]:
        url = item["download_info"]["url"]
        assert url.startswith(wheelhouse.as_uri()), f"{url}: not from the wheelhouse"
        chosen[canonicalize_name(item["metadata"]["name"])] = item
    return chosen


def pins(path: Path) -> dict[str, str]:
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1].strip()
            for line in path.read_text().splitlines() if "==" in line and not line.startswith("#")}


def test_a_wheelhouse_installs_with_no_index_and_no_configuration(tmp_path):
    """Two small pure-Python wheels into a wheelhouse for an x86_64 Linux node, then resolved from it alone."""
    tqdm = next(line for line in (REPO_ROOT / "requirements.txt").read_text().splitlines() if line.startswith("tqdm=="))
    subset = tmp_path / "subset.txt"
    subset.write_text(f"{tqdm}\npackaging=={metadata.version('packaging')}\n")
    wheelhouse, seconds, output = fill_wheelhouse(
        tmp_path, subset, "PLATFORM=manylinux_2_28_x86_64", f"PYTHON_VERSION={sys.version_info[0]}.{sys.version_info[1]}",
        "BUILD_REQUIREMENTS=", timeout=120)
    assert "pins no torch" in output  # the subset has no torch: nothing from PyTorch's index
    assert sorted(p.name for p in wheelhouse.iterdir()) == sorted(
        f"{name}-{version}-py3-none-any.whl" for name, version in
        [line.split("==") for line in subset.read_text().split()])
    chosen = resolve_offline(tmp_path, wheelhouse, subset)
    assert {name: item["metadata"]["version"] for name, item in chosen.items()} == pins(subset)
    # and without the wheelhouse, the same resolution has nothing to draw from
    shutil.rmtree(wheelhouse)
    wheelhouse.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
                           "--find-links", str(wheelhouse), "-r", str(subset)], env=isolated_pip_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "No matching distribution" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("COURSE_TEST_WHEELHOUSE") != "1",
                    reason="opt-in (minutes, about 1 GB of downloads): COURSE_TEST_WHEELHOUSE=1")
def test_full_wheelhouse_of_requirements_txt_resolves_offline(tmp_path):
    """Every pin of requirements.txt for this machine's platform, torch from COURSE_TEST_TORCH_INDEX_URL (default:
    PyTorch's CPU index; empty: pip's own configuration, e.g. a find-links folder with the CPU wheel)."""
    torch_index = os.environ.get("COURSE_TEST_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
    requirements = REPO_ROOT / "requirements.txt"
    wheelhouse, seconds, output = fill_wheelhouse(tmp_path, requirements, f"TORCH_INDEX_URL={torch_index}",
                                                  timeout=3600)
    files = sorted(wheelhouse.iterdir())
    assert files and all(p.suffix == ".whl" for p in files), [p.name for p in files if p.suffix != ".whl"]
    size = sum(p.stat().st_size for p in files)
    chosen = resolve_offline(tmp_path, wheelhouse, requirements)
    for name, version in pins(requirements).items():
        assert name in chosen and chosen[name]["metadata"]["version"].split("+")[0] == version, name
    torch = chosen["torch"]["metadata"]["version"]
    print(f"\nwheelhouse: {len(files)} wheels, {size / 2**20:.0f} MiB, filled in {seconds:.0f} s; torch {torch}; "
          f"{len(chosen)} packages resolve offline from it")


# ----------------------------------------------------------------------------------------------- doctor
def run_doctor(capsys) -> tuple[int, list[str]]:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import doctor
    finally:
        sys.path.pop(0)
    code = doctor.main()
    return code, capsys.readouterr().out.splitlines()


def test_doctor_prints_one_status_line_per_fact_and_check(capsys):
    code, lines = run_doctor(capsys)
    found = {}
    for line in lines[:-1]:
        match = STATUS_LINE.match(line)
        assert match, f"not an `ok/—/FAIL name: value` line: {line!r}"
        found[match.group(2)] = match.group(1)
    for name in ("platform", "python", "torch", "cuda devices", "mps", "deepspeed", "device", "distributed backend",
                 "start method", "nvidia-smi", "torch.version.cuda", "cuda available", "device count",
                 "bf16 supported", "NCCL version"):
        assert name in found, (name, lines)
    assert code == (1 if "FAIL" in found.values() else 0)
    if shutil.which("nvidia-smi") is None:  # a laptop, a CI machine: nothing to fix
        assert code == 0 and lines[-1] == "no check failed", "\n".join(lines)


def test_doctor_reports_a_bad_setting_as_a_fail_line_not_a_traceback(capsys, monkeypatch):
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "thread")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo0")
    code, lines = run_doctor(capsys)
    assert code == 1 and lines[-1] == "1 check(s) failed", "\n".join(lines)
    assert any(line.startswith("FAIL start method: ") and "COURSE_LAUNCH_START_METHOD" in line for line in lines), (
        "\n".join(lines))
    assert "—    GLOO_SOCKET_IFNAME: lo0" in lines


def test_make_doctor_runs_the_script_without_installing_anything(tmp_path):
    done = make("-n", "doctor", f"VENV={tmp_path / 'venv'}", f"PYTHON={sys.executable}")
    assert done.returncode == 0 and done.stdout.strip() == f"{sys.executable} scripts/doctor.py", done.stdout

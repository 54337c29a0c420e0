"""Shared test setup: the repository root, scripts/ on sys.path (so tests can `import grading`), fixtures.

tests/ mirrors course_lib/ (tests/<sub-package>/test_<module>.py); tests/course/ checks the notebooks, the book,
the grading round trip and the environment.
"""

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # `from conftest import section_stdout` from any test folder


@pytest.fixture
def one_thread():
    """Small models train fastest on one thread, and then do not fight other processes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bench_quick(tmp_path_factory):
    """One `scripts/bench.py --quick --json` run of every section, shared by the bench tests: (stdout, report).

    Under pytest-xdist (`make test` runs two workers) the bench files may run on both workers: the first worker runs
    bench.py, the other waits for it (a lock in the folder the run's workers share) and reads its results."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # <run>/popen-gw<n> under xdist
    out, printed = shared / "bench_quick.json", shared / "bench_quick.txt"
    with open(shared / "bench_quick.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "--quick", "--json",
                                   str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            printed.write_text(proc.stdout)
    return printed.read_text(), json.loads(out.read_text())


def section_stdout(stdout: str, section: str) -> str:
    """The tables one bench section printed (each starts with a line `== <section>: <title>`)."""
    blocks = stdout.split("\n== ")
    return "\n".join(block for block in blocks if block.lstrip("= ").startswith(f"{section}:"))


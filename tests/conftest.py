"""Shared test setup: the repository root, scripts/ on sys.path (so tests can `import grading`), fixtures.

tests/ mirrors course_lib/ (tests/<sub-package>/test_<module>.py); tests/course/ checks the notebooks, the book,
the grading round trip and the environment.
"""

import json
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
    """One `scripts/bench.py --quick --json` run of every section, shared by the bench tests: (stdout, report)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "--quick", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def section_stdout(stdout: str, section: str) -> str:
    """The tables one bench section printed (each starts with a line `== <section>: <title>`)."""
    blocks = stdout.split("\n== ")
    return "\n".join(block for block in blocks if block.lstrip("= ").startswith(f"{section}:"))


def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two workers (pytest-xdist, `-n 2 --dist loadgroup`). Each test file is one
    group, so a worker builds its module fixtures once (the grading suite's graded mutants, the book build); the
    bench files share one group, whose session fixture runs bench.py once; the notebooks, each a run of its own,
    spread over both workers. Without xdist, nothing changes."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    tests_dir = REPO_ROOT / "tests"
    for item in items:
        relative = Path(item.fspath).relative_to(tests_dir)
        if relative.name == "test_notebooks.py":
            continue
        item.add_marker(pytest.mark.xdist_group("bench" if relative.parts[0] == "bench" else str(relative)))

"""Shared test setup: the repository root, scripts/ on sys.path (so tests can `import grading`), fixtures."""

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))


@pytest.fixture
def one_thread():
    """Small models train fastest on one thread, and then do not fight other processes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

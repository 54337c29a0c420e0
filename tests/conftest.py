"""Shared test setup: the repository root, and scripts/ on sys.path so tests can `import grading`."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

"""Draw the diagrams of the GPU-cluster chapters (course_lib.viz.diagrams) into book/_static/figures/.

    .venv/bin/python scripts/make_figures.py                 # rewrite every figure (commit the PNGs)
    .venv/bin/python scripts/make_figures.py --check         # exit 1 if a committed figure is stale or missing
    .venv/bin/python scripts/make_figures.py --out-dir /tmp/figures

The PNGs are committed, so the book builds without drawing anything; tests/viz/test_diagrams.py runs --check so
that a change to a diagram's code cannot leave an old picture in the book. Drawing is deterministic (default
matplotlib style, no metadata); --check still compares pixels with a small tolerance (matplotlib's
compare_images), so that a different FreeType build cannot fail it on anti-aliasing alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed

from matplotlib.testing.compare import compare_images  # noqa: E402
from matplotlib.testing.exceptions import ImageComparisonFailure  # noqa: E402

from course_lib.viz.diagrams import FIGURES, save_all  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
FIGURE_DIR = REPO_ROOT / "book" / "_static" / "figures"
TOLERANCE = 2.0  # RMS difference of pixel values (0-255) that still counts as the same picture


def stale_figures(committed: Path, tolerance: float = TOLERANCE) -> list[str]:
    """Problems with the figures in `committed` compared with a fresh drawing: missing, extra or different files."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="figures-") as scratch:
        fresh = {path.name: path for path in save_all(scratch)}
        present = {path.name for path in committed.glob("*.png")} if committed.is_dir() else set()
        problems += [f"{name} is missing from {committed}" for name in sorted(set(fresh) - present)]
        problems += [f"{name} in {committed} is drawn by no function of course_lib.viz.diagrams.FIGURES"
                     for name in sorted(present - set(fresh))]
        for name in sorted(set(fresh) & present):
            try:  # the diff image it may write lands next to the fresh drawing, in the scratch folder
                difference = compare_images(str(committed / name), str(fresh[name]), tol=tolerance)
            except ImageComparisonFailure as error:  # a different size
                difference = str(error)
            if difference is not None:
                problems.append(f"{name} differs from a fresh drawing: {difference.splitlines()[0]}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=FIGURE_DIR)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_figures(args.out_dir)
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print("run `.venv/bin/python scripts/make_figures.py` and commit the figures", file=sys.stderr)
            return 1
        print(f"{len(FIGURES)} figures in {args.out_dir} are up to date")
        return 0
    for path in save_all(args.out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every student notebook in notebooks/ runs from top to bottom with papermill, once (slow).

    .venv/bin/python -m pytest -q tests/course/test_notebooks.py
    .venv/bin/python -m pytest -q tests/course/test_notebooks.py -k 03_training_loop     # one notebook

Conventions every notebook follows (tests/course/test_notebook_metadata.py checks the first two):

* One code cell tagged `parameters` (papermill) holds the defaults a learner runs with.
* Quick settings for this test live in the notebook's own metadata, `metadata.course.test_parameters`,
  a dict of parameter name -> value, e.g. {"max_steps": 20, "batch_size": 8}; each name must be
  assigned in the parameters cell. Edit it in JupyterLab (Property Inspector -> Notebook metadata)
  in solutions/, then `make release`.
* Files a notebook writes go under its `out_dir` parameter (runs, checkpoints, logs, figures) and
  `data_dir` parameter (prepared data); relative values are resolved against the repository root,
  absolute ones are used as they are. This test passes fresh temporary folders for both (whichever
  the notebook declares), overriding test_parameters. A notebook declaring neither writes nothing.
* The notebook runs with its own folder as the working directory, as in JupyterLab, on the `python3`
  kernel (the interpreter running pytest, where course_lib is installed). The test fails if the run
  leaves new files in that folder, or under a folder named after the notebook in the repository's
  runs/, logs/ or data/ (where relative defaults such as out_dir="runs/session_a/<notebook>" point).
* Outputs show no folder of the machine (print paths with `course_lib.nbtools.shown`), no path in its temporary
  folder other than the out_dir/data_dir this test passes, and no stderr unless the cell is tagged `show-stderr`
  (scripts/output_checks.py; `make book` checks the built pages the same way).
* A prediction cell (tagged `prediction`, scripts/prediction_checks.py) comes before the measurement it asks
  about: no cell above it prints the number that its reveal cell prints as `measured:`.
* Every cell runs without error, so papermill (which fails on any error) runs the notebook on a GPU node too.
  A cell that fails on purpose to teach an error message wraps the code in
  `with course_lib.nbtools.expect_error(...)`, which prints the traceback and carries on.

Notebooks with autograded cells are skipped: their student version stops at the first exercise by
design, and tests/course/test_grading.py executes them through `nbgrader autograde` (solutions and skeletons).
"""

from __future__ import annotations

import time
from pathlib import Path

import grading  # scripts/ is on sys.path (tests/conftest.py)
import nbformat
import papermill
import pytest
from output_checks import machine_folders, output_problems
from prediction_checks import revealed_too_early

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*/*.ipynb"))
OUTPUT_PARAMETERS = ("out_dir", "data_dir")
WATCHED_DIRS = ("runs", "logs", "data")
CELL_TIMEOUT_S = 900


def files_under(*folders: Path) -> set[Path]:
    return {p for folder in folders if folder.is_dir() for p in folder.rglob("*") if p.is_file()}


def has_graded_cells(nb) -> bool:
    return any(cell.metadata.get("nbgrader", {}).get("grade") for cell in nb.cells)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks under notebooks/<assignment>/: run `make release`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO_ROOT / "notebooks")))
def test_notebook_runs(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    if has_graded_cells(nb):
        pytest.skip("graded notebook: executed by tests/course/test_grading.py through nbgrader autograde")
    declared = grading.parameter_names(nb)
    parameters = dict(nb.metadata.get("course", {}).get("test_parameters", {}))
    for name in OUTPUT_PARAMETERS:
        if name in declared:
            parameters[name] = str(tmp_path / name)
    watched = [path.parent, *(REPO_ROOT / d for d in WATCHED_DIRS)]
    before = files_under(*watched)

    start = time.perf_counter()
    executed_path = tmp_path / path.name
    papermill.execute_notebook(str(path), str(executed_path), parameters=parameters, kernel_name="python3",
                               cwd=str(path.parent), progress_bar=False, log_output=False,
                               execution_timeout=CELL_TIMEOUT_S)  # raises PapermillExecutionError on any error
    print(f"{path.name}: {time.perf_counter() - start:.0f} s with {parameters}")

    # Other processes (a training script, another notebook) may write to runs/ meanwhile: count only
    # files in this notebook's folder or under a folder named after it (where its defaults write).
    left_behind = sorted(str(p.relative_to(REPO_ROOT)) for p in files_under(*watched) - before
                         if path.parent in p.parents or path.stem in p.relative_to(REPO_ROOT).parts)
    assert not left_behind, (
        f"{path.name} wrote files outside its out_dir/data_dir parameters: {left_behind[:10]}")
    # What the book would show: no folder of this machine and no stderr. tmp_path holds this test's out_dir and
    # data_dir, which stand in for the notebook's runs/ and data/ folders: paths under it may be shown.
    problems = output_problems(nbformat.read(executed_path, as_version=4), machine_folders(),
                               allowed=[str(tmp_path), str(tmp_path.resolve())])
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)
    # Predict, then measure: no measured value is printed above the cell that asks for its prediction.
    early = revealed_too_early(nbformat.read(executed_path, as_version=4))
    assert not early, f"{path.name}:\n  " + "\n  ".join(early)

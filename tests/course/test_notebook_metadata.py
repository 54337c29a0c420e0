"""Every notebook is valid and carries correct nbgrader metadata; no outputs are stored (fast; `make lint`).

    .venv/bin/python -m pytest -q tests/course/test_notebook_metadata.py

Rules for solutions/<assignment>/*.ipynb (the hand-edited notebooks; notebooks/ is generated from them):
valid nbformat; kernelspec `python3`; exactly one code cell tagged `parameters`; every key of
`metadata.course.test_parameters` (quick settings used by tests/course/test_notebooks.py) is assigned in that
cell; nbgrader cells have unique grade ids; autograded test cells are locked code cells with points and
hidden tests; `### BEGIN/END SOLUTION` and `### BEGIN/END HIDDEN TESTS` are balanced and sit only in
solution / autograded cells respectively.

Text: no markdown cell of solutions/ and no book/ page holds a TAB character (or a form feed, backspace or
vertical tab, the other escapes a backslash can produce before a letter) followed by a letter. That is
what a LaTeX command becomes when a tool reads its backslash as an escape: "\\text" written in a
non-raw Python string turns into a TAB + "ext" (likewise "\\times", "\\tau"; "\\frac" → form feed + "rac").
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from grading import marked_regions, parameter_names  # scripts/ is on sys.path (tests/conftest.py)

REPO_ROOT = Path(__file__).resolve().parents[2]

SOLUTIONS = sorted((REPO_ROOT / "solutions").glob("*/*.ipynb"))
RELEASED = sorted((REPO_ROOT / "notebooks").glob("*/*.ipynb"))
BOOK_PAGES = sorted(p for p in (REPO_ROOT / "book").rglob("*.md") if "_static" not in p.parts)
EATEN_BACKSLASH = re.compile(r"[\t\f\b\v][A-Za-z]")  # "\text", "\frac", "\beta", "\vec" with the backslash eaten


def ident(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def read(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return nb


def nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def test_there_are_notebooks():
    assert SOLUTIONS, "no notebooks under solutions/<assignment>/"


@pytest.mark.parametrize("path", SOLUTIONS + RELEASED, ids=ident)
def test_valid_and_without_outputs(path):
    nb = read(path)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{ident(path)}: kernelspec must be python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{ident(path)}, cell {cell.get('id')}: outputs are stored; clear them before committing"
            assert "raises-exception" not in cell.metadata.get("tags", []), (
                f"{ident(path)}, cell {cell.get('id')}: papermill stops at any error; wrap code that fails on "
                "purpose in `with course_lib.nbtools.expect_error(...)` instead of tagging it raises-exception")


@pytest.mark.parametrize("path", SOLUTIONS, ids=ident)
def test_parameters_cell(path):
    nb = read(path)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{ident(path)}: {len(tagged)} cells tagged `parameters`, need exactly one"
    assert tagged[0].cell_type == "code"
    assigned = parameter_names(nb)
    test_parameters = nb.metadata.get("course", {}).get("test_parameters", {})
    assert isinstance(test_parameters, dict), f"{ident(path)}: metadata.course.test_parameters must be a dict"
    unknown = sorted(set(test_parameters) - assigned)
    assert not unknown, f"{ident(path)}: test_parameters {unknown} are not assigned in the parameters cell ({sorted(assigned)})"


@pytest.mark.parametrize("path", SOLUTIONS, ids=ident)
def test_nbgrader_metadata(path):
    nb = read(path)
    grade_ids = [nbgrader(c)["grade_id"] for c in nb.cells if nbgrader(c)]
    duplicates = sorted({g for g in grade_ids if grade_ids.count(g) > 1})
    assert not duplicates, f"{ident(path)}: duplicate grade_id(s) {duplicates}"
    for cell in nb.cells:
        meta, where = nbgrader(cell), f"{ident(path)}, cell {cell.get('id')}"
        if meta:
            assert meta.get("schema_version") == 3 and meta.get("grade_id"), f"{where}: nbgrader metadata needs schema_version 3 and a grade_id"
        solutions = marked_regions(cell.source, "SOLUTION")  # raises if unbalanced
        hidden = marked_regions(cell.source, "HIDDEN TESTS")
        if meta.get("grade"):
            assert cell.cell_type == "code", f"{where}: autograded cells must be code cells"
            assert meta.get("locked"), f"{where}: autograded test cells must be locked"
            assert not meta.get("solution"), f"{where}: a test cell must not also be a solution cell"
            assert isinstance(meta.get("points"), (int, float)) and meta["points"] > 0, f"{where}: needs points > 0"
            assert hidden and any(line.strip() for region in hidden for line in region), \
                f"{where}: every autograded test cell needs hidden tests (### BEGIN HIDDEN TESTS)"
        else:
            assert not hidden, f"{where}: hidden tests outside an autograded test cell"
        if meta.get("solution"):
            assert not meta.get("locked"), f"{where}: solution cells must be editable"
            assert cell.cell_type != "code" or solutions, f"{where}: solution cell without ### BEGIN SOLUTION"
        else:
            assert not solutions, f"{where}: a solution region in a cell not marked as a solution cell"


@pytest.mark.parametrize("path", SOLUTIONS, ids=ident)
def test_graded_notebooks_pair_solutions_with_tests(path):
    nb = read(path)
    solution_cells = [c for c in nb.cells if nbgrader(c).get("solution") and c.cell_type == "code"]
    graded = [c for c in nb.cells if nbgrader(c).get("grade")]
    assert len(graded) >= len(solution_cells), \
        f"{ident(path)}: {len(solution_cells)} code solution cells but only {len(graded)} autograded test cells"


def eaten_backslashes(text: str) -> list[str]:
    """Each line of `text` where a control character (TAB, form feed, backspace, vertical tab) is followed by a
    letter, shown with the character escaped."""
    return [ascii(line.strip())[:120] for line in text.splitlines() if EATEN_BACKSLASH.search(line)]


@pytest.mark.parametrize("path", SOLUTIONS, ids=ident)
def test_markdown_cells_have_no_eaten_backslashes(path):
    nb = read(path)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            bad = eaten_backslashes(cell.source)
            assert not bad, (f"{ident(path)}, cell {cell.get('id')}: a LaTeX backslash was read as an escape "
                             f"(e.g. \\text -> TAB + 'ext'); restore the backslash: {bad}")


def test_book_pages_have_no_eaten_backslashes():
    assert BOOK_PAGES, "no book pages found"
    bad = {str(p.relative_to(REPO_ROOT)): lines for p in BOOK_PAGES
           if (lines := eaten_backslashes(p.read_text(encoding="utf-8")))}
    assert not bad, f"a LaTeX backslash was read as an escape (e.g. \\text -> TAB + 'ext'): {bad}"


def test_the_eaten_backslash_check_catches_what_it_should():
    assert eaten_backslashes("$p + (-\text{lr}) \\cdot g$") == [ascii("$p + (-\text{lr}) \\cdot g$")]
    assert eaten_backslashes("$\\frac{a}{b}$ and\tindented") != []  # a TAB before a letter fails anyway
    assert eaten_backslashes("$\\text{lr} \\cdot g$, \\frac{a}{b}") == []
    assert eaten_backslashes("a\t$x$ and a\t1") == []  # a TAB before anything else is left alone

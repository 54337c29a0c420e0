"""Folded hints in the graded notebooks: an exercise's text says what to build and how it is checked, and its
hints, folded under the text, say how (fast; no notebook runs).

    .venv/bin/python -m pytest -q tests/course/test_hints.py

Rules, for every graded student notebook in notebooks/ (one with nbgrader grade cells):

* a markdown cell that names a numbered hint ("Hint 1", "hint 2") does so only as the summary of a folded block,
  each block exactly of the form `<details><summary>Hint N</summary>`, a blank line, the text, a blank line,
  `</details>`; the blocks of a cell are balanced, not nested, and numbered 1, 2, 3 ... in order;
* every graded notebook is in HINTED, and every notebook of HINTED gives every exercise at least one such block. An exercise is a solution cell of
  nbgrader; its hints sit in the markdown cells between the previous autograded test cell and that solution cell.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RELEASED = sorted((REPO_ROOT / "notebooks").glob("*/*.ipynb"))

# notebooks/<assignment>/<name>.ipynb whose every exercise has at least one folded hint.
HINTED = (
    "session_a/02_model_from_scratch",
    "session_b/02b_ddp_exercises",
    "session_b/05_trainer_exercises",
    "session_c/02_cluster_exercises",
    "session_c/03b_job_exercises",
    "session_c/06_debugging_lab",
    "session_c/07_debugging_lab_silent",
    "session_d/02b_zero_exercises",
    "session_d/04_sharding_exercises",
    "session_e/02b_model_parallel_exercises",
    "session_e/03b_3d_exercises",
    "session_e/04b_lora_exercises",
    "session_f/01b_long_context_exercises",
    "session_f/02b_expert_parallel_exercises",
)

HINT_MENTION = re.compile(r"\bhint\s+\d+", re.IGNORECASE)
DETAILS_TAG = re.compile(r"</?details\b[^>]*>", re.IGNORECASE)
HINT_BLOCK = re.compile(r"<details><summary>Hint (\d+)</summary>\n\n(?!\s)(.+?)(?<!\s)\n\n</details>", re.DOTALL)


def nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def is_graded(nb) -> bool:
    return any(nbgrader(cell).get("grade") for cell in nb.cells)


def ident(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT / "notebooks").with_suffix(""))


GRADED = [path for path in RELEASED if is_graded(nbformat.read(path, as_version=4))]


def hint_problems(text: str) -> list[str]:
    """What is wrong with the numbered hints of one markdown cell (nothing for a cell that names none)."""
    if not HINT_MENTION.search(text):
        return []
    problems, depth, start, blocks = [], 0, 0, []
    for tag in DETAILS_TAG.finditer(text):
        if tag.group().startswith("</"):
            if depth == 0:
                problems.append(f"a </details> closes nothing, at {text[tag.start():tag.start() + 40]!r}")
                continue
            depth -= 1
            blocks.append((start, tag.end()))
        else:
            if depth:
                problems.append(f"a <details> block opens inside another, at {text[tag.start():tag.start() + 40]!r}")
            depth += 1
            start = tag.start()
    if depth:
        problems.append("a <details> block is never closed")
    numbers, summaries = [], set()
    for begin, end in blocks:
        block = HINT_BLOCK.fullmatch(text, begin, end)
        if block is None:
            if HINT_MENTION.search(text, begin, end):
                problems.append(f"not of the form <details><summary>Hint N</summary>, blank line, text, blank line, "
                                f"</details>: {text[begin:end]!r}")
            continue
        numbers.append(int(block.group(1)))
        summaries.add(block.start(1) - len("Hint "))
    for mention in HINT_MENTION.finditer(text):
        if mention.start() not in summaries:
            problems.append(f"{mention.group()!r} outside the <summary> of a folded hint: "
                            f"{text[max(0, mention.start() - 40):mention.end() + 40]!r}")
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"the hints are numbered {numbers}, not 1, 2, 3 ... in order")
    return problems


def folded_hints_per_exercise(nb) -> dict[str, int]:
    """{solution cell's grade id: folded hints in the markdown cells between the previous test cell and it}."""
    counts, hints = {}, 0
    for cell in nb.cells:
        meta = nbgrader(cell)
        if cell.cell_type == "markdown":
            hints += len(HINT_BLOCK.findall(cell.source))
        elif meta.get("solution"):
            counts[meta["grade_id"]] = hints
        elif meta.get("grade"):
            hints = 0
    return counts


def test_there_are_graded_notebooks():
    assert GRADED, "no graded notebook under notebooks/<assignment>/"


@pytest.mark.parametrize("path", GRADED, ids=ident)
def test_numbered_hints_are_folded(path):
    nb = nbformat.read(path, as_version=4)
    problems = [f"cell {cell.get('id')}: {problem}" for cell in nb.cells if cell.cell_type == "markdown"
                for problem in hint_problems(cell.source)]
    assert not problems, f"{ident(path)}:\n" + "\n".join(problems)


def test_every_graded_notebook_is_hinted():
    assert sorted(map(ident, GRADED)) == sorted(HINTED), "HINTED must list exactly the graded notebooks"


@pytest.mark.parametrize("name", HINTED)
def test_every_exercise_has_a_folded_hint(name):
    path = REPO_ROOT / "notebooks" / f"{name}.ipynb"
    assert path.exists(), f"HINTED names {name}, but there is no {path.relative_to(REPO_ROOT)}"
    nb = nbformat.read(path, as_version=4)
    assert is_graded(nb), f"{name} has no graded cells: it has no exercises"
    counts = folded_hints_per_exercise(nb)
    assert counts, f"{name}: no solution cells"
    bare = [grade_id for grade_id, hints in counts.items() if hints == 0]
    assert not bare, (f"{name}: no <details><summary>Hint 1</summary> block between the previous test cell and the "
                      f"solution cells {bare}")


def test_the_hint_check_catches_what_it_should():
    def block(n, text="Look at the last dimension."):
        return f"<details><summary>Hint {n}</summary>\n\n{text}\n\n</details>"

    good = f"## Exercise\n\nWrite f.\n\n{block(1)}\n\n{block(2)}"
    assert hint_problems(good) == []
    assert hint_problems("Write f. Hints come later; none is numbered.") == []
    assert hint_problems("Write f.\n\n<details><summary>Solution</summary>\n\nx\n\n</details>") == []
    bad = {
        "unfolded": "Write f.\n\nHint 1: look at the last dimension.",
        "unfolded after a block": f"{block(1)}\n\nHint 2: slice it.",
        "no blank lines": "<details><summary>Hint 1</summary>\nLook.\n</details>",
        "empty": "<details><summary>Hint 1</summary>\n\n\n\n</details>",
        "never closed": "<details><summary>Hint 1</summary>\n\nLook.\n\n",
        "closes nothing": f"{block(1)}\n\n</details>",
        "nested": f"<details><summary>Hint 1</summary>\n\n{block(2)}\n\n</details>",
        "numbered from 2": block(2),
        "out of order": f"{block(2)}\n\n{block(1)}",
        "a hint named in the text of another": f"{block(1)}\n\n{block(2, 'As in Hint 1, the other way.')}",
        "lower case": "<details><summary>hint 1</summary>\n\nLook.\n\n</details>",
    }
    for name, text in bad.items():
        assert hint_problems(text), f"the check misses a bad hint: {name}"
    nb = nbformat.v4.new_notebook()
    solution = nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {"solution": True, "grade_id": "ex1"}})
    tests = nbformat.v4.new_code_cell("assert x", metadata={"nbgrader": {"grade": True, "grade_id": "ex1_tests"}})
    second = nbformat.v4.new_code_cell("y = 1", metadata={"nbgrader": {"solution": True, "grade_id": "ex2"}})
    nb.cells = [nbformat.v4.new_markdown_cell(good), solution, tests, nbformat.v4.new_markdown_cell("Write y."), second]
    assert folded_hints_per_exercise(nb) == {"ex1": 2, "ex2": 0}

"""A graded notebook read as a list of exercises: what each one runs before the learner's code, the
learner's cells, the reference answer, and the test cell.

In the instructor's notebook (solutions/<assignment>/<name>.ipynb) an exercise is one autograded test cell
(nbgrader `grade: true`, with points) and the solution cells between it and the previous test cell. What
runs before the answer is the notebook's `parameters` cell and its read-only setup cells (nbgrader
`locked: true`) above the test cell: never a cell the learner can edit, never another exercise's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nbformat

SOLUTION_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


@dataclass(frozen=True)
class Exercise:
    test_id: str                       # the autograded test cell's grade_id
    points: float
    answer_ids: tuple[str, ...]        # the solution cells it grades, in notebook order
    references: tuple[str, ...]        # their reference code (solution markers removed)
    test_code: str                     # visible and hidden tests
    context_upto: int                  # how many of Notebook.context cells run before the answer


@dataclass(frozen=True)
class GradedNotebook:
    path: Path
    context: tuple[str, ...]           # parameters and read-only setup cells, in notebook order
    exercises: tuple[Exercise, ...]

    def exercise(self, test_id: str) -> Exercise:
        for exercise in self.exercises:
            if exercise.test_id == test_id:
                return exercise
        raise KeyError(f"{self.path.name} has no autograded test cell {test_id!r}: "
                       f"{[e.test_id for e in self.exercises]}")


def nbgrader_metadata(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def without_markers(source: str) -> str:
    """A solution cell as a learner would write it: the solution code without nbgrader's marker lines."""
    return "\n".join(line for line in source.splitlines() if not line.strip().startswith(SOLUTION_MARKERS))


def read_exercises(path: Path | str) -> GradedNotebook:
    """The exercises of an instructor notebook (see the module docstring)."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    context: list[str] = []
    exercises: list[Exercise] = []
    pending: list[tuple[str, str]] = []
    for cell in nb.cells:
        meta = nbgrader_metadata(cell)
        if cell.cell_type != "code":
            continue
        if meta.get("grade") and not meta.get("solution"):
            if not pending:
                raise ValueError(f"{path}: test cell {meta.get('grade_id')!r} has no solution cell above it "
                                 "(after the previous test cell)")
            exercises.append(Exercise(meta["grade_id"], float(meta.get("points", 0)),
                                      tuple(cell_id for cell_id, _ in pending),
                                      tuple(code for _, code in pending), cell.source, len(context)))
            pending = []
        elif meta.get("solution"):
            pending.append((meta["grade_id"], without_markers(cell.source)))
        elif "parameters" in cell.metadata.get("tags", []) or meta.get("locked"):
            context.append(cell.source)
    return GradedNotebook(path, tuple(context), tuple(exercises))


def answers_in(nb) -> dict[str, str]:
    """{solution cell id: the learner's code} of a submitted notebook (an nbformat notebook)."""
    return {nbgrader_metadata(cell)["grade_id"]: cell.source for cell in nb.cells
            if cell.cell_type == "code" and nbgrader_metadata(cell).get("solution")
            and not nbgrader_metadata(cell).get("grade")}

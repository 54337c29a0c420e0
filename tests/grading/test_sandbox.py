"""The grading sandbox on a small instructor notebook: what runs (setup from the instructor's notebook, the
exercise's own answer, its tests), what does not (the learner's other cells), and how a check ends.

    .venv/bin/python -m pytest -q tests/grading/test_sandbox.py
"""

from __future__ import annotations

import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from course_tools.grading import answers_in, grade, read_exercises


def cell(source: str, grade_id: str | None = None, *, solution=False, test_points=None, locked=False, tags=()):
    code = new_code_cell(source)
    if tags:
        code.metadata["tags"] = list(tags)
    if grade_id:
        code.metadata["nbgrader"] = {"grade_id": grade_id, "solution": solution, "grade": test_points is not None,
                                     "locked": locked or test_points is not None, "schema_version": 3}
        if test_points is not None:
            code.metadata["nbgrader"]["points"] = test_points
    return code


TESTS_TWICE = '''assert twice(3) == 6, "twice(3) should be 6"
print("visible tests passed")
### BEGIN HIDDEN TESTS
assert type(twice(-2)) is int and twice(-2) == -4
print("hidden tests passed")
### END HIDDEN TESTS'''


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    nb = new_notebook(cells=[
        cell("factor = 2", tags=["parameters"]),
        cell("import math\nimport torch\nLIMIT = 10", "setup", locked=True),
        cell("def twice(x):\n    ### BEGIN SOLUTION\n    return factor * x\n    ### END SOLUTION", "ex1", solution=True),
        cell(TESTS_TWICE, "ex1_tests", test_points=1),
        cell("UNLOCKED = 'a lesson cell the learner may edit'"),
        cell("def root(x):\n    ### BEGIN SOLUTION\n    return math.sqrt(x)\n    ### END SOLUTION", "ex2", solution=True),
        cell("assert root(9.0) == 3.0\nassert abs(root(2.0) - 2 ** 0.5) < 1e-12\nprint('ok')", "ex2_tests",
             test_points=2),
    ])
    path = tmp_path_factory.mktemp("course") / "exercises.ipynb"
    nbformat.write(nb, path)
    return path


RIGHT = {"ex1": "def twice(x):\n    return x + x", "ex2": "def root(x):\n    return x ** 0.5"}


def test_exercises_are_read_from_the_instructor_notebook(source):
    notebook = read_exercises(source)
    assert notebook.context == ("factor = 2", "import math\nimport torch\nLIMIT = 10")
    assert [(e.test_id, e.points, e.answer_ids, e.context_upto) for e in notebook.exercises] == [
        ("ex1_tests", 1.0, ("ex1",), 2), ("ex2_tests", 2.0, ("ex2",), 2)]
    assert notebook.exercises[0].references == ("def twice(x):\n    return factor * x",)


def test_right_answers_pass_and_print_what_the_tests_print(source):
    results = grade(source, {"alice": RIGHT})["alice"]
    assert results["ex1_tests"].passed and results["ex2_tests"].passed
    assert results["ex1_tests"].output == "visible tests passed\nhidden tests passed\n"
    assert results["ex1_tests"].error == ""


def test_each_exercise_is_graded_on_its_own(source):
    results = grade(source, {"bob": {"ex1": "def twice(x):\n    return 2 * abs(x)", "ex2": RIGHT["ex2"]}})["bob"]
    assert not results["ex1_tests"].passed and results["ex2_tests"].passed
    assert "visible tests passed" in results["ex1_tests"].output  # only the hidden test caught it
    assert "AssertionError" in results["ex1_tests"].error


def test_the_stub_and_a_missing_cell_fail(source):
    stub = "    # YOUR CODE HERE\n    raise NotImplementedError()"
    untouched = {"ex1": "def twice(x):\n" + stub, "ex2": "def root(x):\n" + stub}
    results = grade(source, {"untouched": untouched, "no-cell": {"ex2": RIGHT["ex2"]}})
    assert not any(r.passed for r in results["untouched"].values())
    assert "NotImplementedError" in results["untouched"]["ex1_tests"].error
    assert "missing from the submission" in results["no-cell"]["ex1_tests"].error
    assert results["no-cell"]["ex2_tests"].passed


def test_cheats_are_refused_before_they_run(source):
    cheats = {
        "rebinds-the-builtin": "def twice(x):\n    return 0\ntype = lambda x: int",
        "patches-math": "import math\nmath.sqrt = lambda x: 3.0\ndef root(x):\n    return 3.0",
        "kernel": "get_ipython().ast_transformers.append(None)\ndef twice(x):\n    return 0",
        "lying": "class Any_:\n    def __eq__(self, other):\n        return True\ndef twice(x):\n    return Any_()",
        "delegates": "twice = print",
    }
    submissions = {name: {**RIGHT, ("ex2" if "math" in name else "ex1"): code} for name, code in cheats.items()}
    results = grade(source, submissions)
    for name in cheats:
        test_id = "ex2_tests" if "math" in name else "ex1_tests"
        assert not results[name][test_id].passed, name
        assert results[name][test_id].error.startswith("AnswerRefused"), (name, results[name][test_id].error)


def test_only_the_named_exercises_are_graded(source):
    results = grade(source, {"a": RIGHT, "b": RIGHT}, only={"a": ["ex2_tests"]})
    assert set(results["a"]) == {"ex2_tests"} and results["b"] == {}
    with pytest.raises(KeyError, match="no autograded test cells"):
        grade(source, {"a": RIGHT}, only=["ex9_tests"])


def test_a_check_that_runs_too_long_is_stopped(source):
    start = time.perf_counter()
    results = grade(source, {"slow": {**RIGHT, "ex1": "def twice(x):\n    while True:\n        pass"}},
                    only=["ex1_tests"], timeout_s=2)
    assert not results["slow"]["ex1_tests"].passed
    assert "Timeout" in results["slow"]["ex1_tests"].error
    assert time.perf_counter() - start < 30


def test_an_exit_from_the_answer_is_a_failure(source):
    results = grade(source, {"exits": {**RIGHT, "ex1": "raise SystemExit(0)\ndef twice(x):\n    return 2 * x"}},
                    only=["ex1_tests"])
    assert not results["exits"]["ex1_tests"].passed and "SystemExit" in results["exits"]["ex1_tests"].error


def test_answers_are_read_from_the_solution_cells_of_a_submission(source):
    nb = nbformat.read(source, as_version=4)
    assert set(answers_in(nb)) == {"ex1", "ex2"}


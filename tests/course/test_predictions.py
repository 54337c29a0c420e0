"""Lesson notebooks ask before they tell: predict, then measure (fast; checks the notebooks' source).

    .venv/bin/python -m pytest -q tests/course/test_predictions.py

The lessons of Sessions B to E hold prediction cells (code cells tagged `prediction`): the learner writes a number,
or one of a few choices, into a variable that starts as None; the notebook measures; a later cell prints the
measurement next to the prediction with `course_lib.nbtools.reveal_number` or `reveal`. Each prediction is
revealed by a later cell, and no cell above it mentions its variable (scripts/prediction_checks.py).
tests/course/test_notebooks.py checks, after running each notebook, that no cell above a prediction printed the
number its reveal cell prints as measured.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from prediction_checks import (is_prediction, measured_numbers, numbers_in,  # scripts/ is on sys.path (conftest)
                               prediction_problems, revealed_too_early, significant_digits)

from course_lib.nbtools import format_number, reveal_number

REPO_ROOT = Path(__file__).resolve().parents[2]
SESSIONS = ("session_b", "session_c", "session_d", "session_e", "session_f")
NOTEBOOKS = sorted(p for s in SESSIONS for p in (REPO_ROOT / "notebooks" / s).glob("*.ipynb"))
MIN_PREDICTIONS = 25


def ident(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def test_sessions_b_to_e_ask_for_predictions():
    counts = {ident(p): sum(map(is_prediction, nbformat.read(p, as_version=4).cells)) for p in NOTEBOOKS}
    assert sum(counts.values()) >= MIN_PREDICTIONS, (
        f"{sum(counts.values())} prediction cells in Sessions B-E, need at least {MIN_PREDICTIONS}: {counts}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ident)
def test_every_prediction_is_revealed_below_and_unmentioned_above(path):
    problems = prediction_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{ident(path)}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------ reveal_number

def test_reveal_number_with_a_prediction(capsys):
    reveal_number("bytes rank 0 sends", 800_000, 786_432, unit="bytes", explain="2 (n - 1)/n of the message")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["bytes rank 0 sends",
                     "  measured: 786,432 bytes",
                     "  your prediction: 800,000 bytes, 2% above the measured value; prediction / measured = 1.02",
                     "  why: 2 (n - 1)/n of the message"]
    reveal_number("speed-up", 1.5, 1.87, unit="x")
    out = capsys.readouterr().out
    assert "measured: 1.87x" in out and "20% below the measured value; prediction / measured = 0.802" in out
    reveal_number("ratio", 31.9, 31.9998)
    assert "within 1% of the measured value" in capsys.readouterr().out
    reveal_number("stage", 5, 5)
    assert "your prediction: 5, exactly the measured value" in capsys.readouterr().out


def test_reveal_number_without_a_prediction(capsys):
    reveal_number("share of the model", None, 52.03, unit="%", explain="the embedding is replicated")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "  measured: 52%" and "no prediction written" in lines[2]
    assert lines[3] == "  why: the embedding is replicated"
    with pytest.raises(ValueError, match="predict a number, got 'ten'"):
        reveal_number("bytes", "ten", 10)


def test_reveal_number_when_the_measurement_is_zero(capsys):
    reveal_number("samples read twice", 2, 0)
    out = capsys.readouterr().out
    assert "measured: 0\n" in out and "2 above the measured 0" in out
    reveal_number("samples read twice", 0, 0)
    assert "exactly the measured value" in capsys.readouterr().out
    reveal_number("scale", 0, 8192)  # a prediction of zero: no ratio to print
    assert "100% below the measured value\n" in capsys.readouterr().out


def test_numbers_are_printed_as_the_checks_read_them():
    assert [format_number(x) for x in (786432, 2048.0, 0.08571428, 31.9998, 1234.5, 1e-8)] == \
        ["786,432", "2,048", "0.0857", "32", "1,234", "1e-08"]
    assert measured_numbers("q\n  measured: 786,432 bytes\nq\n  measured: 1.87x\nq\n  measured: 'same'\n"
                            "q\n  measured: 0.0857\n") == [("786,432", "bytes"), ("1.87", "x"), ("0.0857", "")]
    assert [significant_digits(n) for n in ("786,432", "0.0857", "100", "32", "1.87", "1e-08")] == [6, 3, 1, 2, 3, 1]
    text = "sent 786432 B, then 1,024 GPUs at 1.87x (step 3, [1, 2]), 1.58 GB"
    assert numbers_in(text) >= {786432.0, 1024.0, 1.87, 3.0, 1.58}
    assert numbers_in(text, "x") == {1.87} and numbers_in(text, "GPUs") == {1024.0} and numbers_in(text, "B") == {786432.0}


# ------------------------------------------------------------------ the checks themselves

def _notebook(*cells):
    """cells: (kind, source, tags, printed); printed is what a code cell's output shows."""
    nb = nbformat.v4.new_notebook()
    for kind, source, tags, printed in cells:
        cell = nbformat.v4.new_code_cell(source) if kind == "code" else nbformat.v4.new_markdown_cell(source)
        cell.metadata["tags"] = tags
        if printed:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
        nb.cells.append(cell)
    return nb


def test_the_checks_find_a_prediction_without_reveal_a_mention_above_and_a_leak():
    good = _notebook(("markdown", "How many bytes?", [], ""),
                     ("code", "predicted_bytes = None  # bytes", ["prediction"], ""),
                     ("code", "measured = 786432", [], ""),
                     ("code", "reveal_number('bytes', predicted_bytes, measured)", [], "q\n  measured: 786,432\n"))
    assert prediction_problems(good) == [] and revealed_too_early(good) == []
    unrevealed = _notebook(("code", "predicted_bytes = None", ["prediction"], ""), ("code", "print(1)", [], ""))
    assert "no later cell passes predicted_bytes" in prediction_problems(unrevealed)[0]
    no_none = _notebook(("code", "predicted_bytes = 3", ["prediction"], ""))
    assert "assigns None" in prediction_problems(no_none)[0]
    mentioned = _notebook(("code", "predicted_bytes = 7", [], ""))
    mentioned.cells += good.cells
    assert "mentioned above" in prediction_problems(mentioned)[0]
    leaked = _notebook(("code", "print(measured)", [], "786432 bytes\n"))
    leaked.cells += good.cells
    assert "already printed" in revealed_too_early(leaked)[0]
    short = _notebook(("code", "print(10)", [], "10\n"), ("code", "predicted = None", ["prediction"], ""),
                      ("code", "reveal_number('sum', predicted, 10)", [], "q\n  measured: 10\n"))
    assert revealed_too_early(short) == []  # too common a number to count as a leak
    other_unit = _notebook(("code", "print(size)", [], "1.58 GB\n"), ("code", "predicted = None", ["prediction"], ""),
                           ("code", "reveal_number('ratio', predicted, r, unit='x')", [], "q\n  measured: 1.58x\n"))
    assert revealed_too_early(other_unit) == []  # 1.58 GB is another quantity than the ratio 1.58x
    other_unit.cells[0].outputs[0].text = "ratio 1.58x\n"
    assert "reveals 1.58 x" in revealed_too_early(other_unit)[0]

"""Lessons ask before they tell: the checks of the prediction cells of a notebook.

A prediction cell is a code cell tagged `prediction`. It assigns None to a variable, into which the learner writes
a number (or one of a few choices) before the notebook measures it; a later cell passes the variable to
`course_lib.nbtools.reveal_number` (numbers) or `reveal` (choices), which prints the measurement on a line
`measured: <value>` next to the prediction.

    prediction_problems(nb)        # tests/course/test_predictions.py, on every lesson notebook's source
    revealed_too_early(executed)   # tests/course/test_notebooks.py, after each run

prediction_problems: every prediction cell assigns None to at least one variable; every such variable is passed
on by a later cell that calls reveal() or reveal_number(); no cell above the prediction mentions it.

revealed_too_early: a number that a reveal cell prints as `measured:` must not appear among the numbers printed
by the cells above its prediction cell, followed by the same unit when the measurement has one (`measured: 1.58x`
is looked for as 1.58x, not in "1.58 GB"). Only numbers of at least MIN_SIGNIFICANT_DIGITS significant digits are
looked for (2, 10 or 0.5 appear in any output); thousands separators do not matter (786,432 = 786432).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

PREDICTION_TAG = "prediction"
REVEALS = ("reveal", "reveal_number")
MIN_SIGNIFICANT_DIGITS = 3
MEASURED = re.compile(r"^\s*measured: (.*)$", re.MULTILINE)
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
NUMBER_AT_START = re.compile(_NUMBER)
NUMBER_IN_TEXT = re.compile(rf"(?<![\w.,]){_NUMBER}(?!\d)")


@dataclass
class Prediction:
    index: int                 # of the prediction cell
    names: list[str]           # the variables it sets to None
    reveals: list[int]         # the later cells that reveal one of them


def is_prediction(cell) -> bool:
    return PREDICTION_TAG in cell.metadata.get("tags", [])


def _tree(source: str) -> ast.AST | None:
    try:
        return ast.parse(source)
    except SyntaxError:  # IPython magics; no prediction cell or reveal cell has any
        return None


def names_set_to_none(source: str) -> list[str]:
    """The variables a cell's top-level statements assign None to (`x = None`, `x: int | None = None`)."""
    tree = _tree(source)
    names = []
    for node in tree.body if tree else []:
        value = getattr(node, "value", False)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Constant) and value.value is None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def reveals_names(source: str) -> set[str]:
    """The variables a cell passes to reveal() or reveal_number() (directly as an argument)."""
    tree = _tree(source)
    found = set()
    for node in ast.walk(tree) if tree else []:
        if isinstance(node, ast.Call):
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if func in REVEALS:
                arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
                found |= {a.id for a in arguments if isinstance(a, ast.Name)}
    return found


def mentions(source: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", source) is not None


def predictions(nb) -> list[Prediction]:
    found = []
    for i, cell in enumerate(nb.cells):
        if is_prediction(cell):
            names = names_set_to_none(cell.source) if cell.cell_type == "code" else []
            reveals = [j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"
                       and reveals_names(nb.cells[j].source) & set(names)]
            found.append(Prediction(i, names, reveals))
    return found


def prediction_problems(nb) -> list[str]:
    """What is wrong with the prediction cells of a notebook (its source), one line per problem."""
    problems = []
    for p in predictions(nb):
        cell = nb.cells[p.index]
        where = f"cell {p.index} ({cell.get('id')})"
        if cell.cell_type != "code":
            problems.append(f"{where}: a prediction cell must be a code cell")
            continue
        if not p.names:
            problems.append(f"{where}: a prediction cell assigns None to the variable the learner fills in")
        for name in p.names:
            if not any(name in reveals_names(nb.cells[j].source) for j in p.reveals):
                problems.append(f"{where}: no later cell passes {name} to reveal() or reveal_number()")
            above = [k for k in range(p.index) if mentions(nb.cells[k].source, name)]
            if above:
                problems.append(f"{where}: {name} is mentioned above its prediction cell, in cell(s) {above}")
    return problems


def output_text(cell) -> str:
    """What a code cell printed or displayed as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "".join("".join(p) if isinstance(p, list) else p for p in parts)


def significant_digits(number: str) -> int:
    mantissa = re.split(r"[eE]", number.lstrip("+-").replace(",", ""))[0]
    digits = mantissa.replace(".", "").lstrip("0")
    if "." not in mantissa:
        digits = digits.rstrip("0")
    return len(digits)


def measured_numbers(text: str) -> list[tuple[str, str]]:
    """(number, unit) of each `measured:` line that holds a number (a choice such as 'same' is not one)."""
    found = []
    for line in MEASURED.findall(text):
        match = NUMBER_AT_START.match(line)
        if match:
            found.append((match.group(), line[match.end():].strip()))
    return found


def numbers_in(text: str, unit: str = "") -> set[float]:
    """The numbers in text; with a unit, only those the unit follows (after optional spaces)."""
    after = re.compile(rf"[ \t]*{re.escape(unit)}(?!\w)") if unit else None
    return {float(m.group().replace(",", "")) for m in NUMBER_IN_TEXT.finditer(text)
            if after is None or after.match(text, m.end())}


def revealed_too_early(nb) -> list[str]:
    """For an executed notebook: each measured number a reveal cell printed that a cell above its prediction had
    already printed."""
    problems = []
    for p in predictions(nb):
        above = "".join(output_text(c) for c in nb.cells[:p.index] if c.cell_type == "code")
        for j in p.reveals:
            for number, unit in measured_numbers(output_text(nb.cells[j])):
                if (significant_digits(number) >= MIN_SIGNIFICANT_DIGITS
                        and float(number.replace(",", "")) in numbers_in(above, unit)):
                    problems.append(f"cell {j} reveals {number}{unit and ' ' + unit} for {', '.join(p.names)}, but "
                                    f"a cell above the prediction (cell {p.index}) already printed it")
    return problems

"""Small conveniences for the course notebooks.

`repo_root()` finds the repository, so relative paths such as runs/ and data/ mean the same place whether a
notebook is opened from its own folder, from the repository root, or run by papermill elsewhere.

`expect_error()` runs a block that fails on purpose (a lesson about reading error messages) and prints the
error the way Jupyter would, without stopping the notebook: papermill and nbgrader then run the notebook end
to end, and the reader still sees the traceback.

    with expect_error(ValueError):
        GPTConfig(n_embd=100, n_head=3)

`shown(path)` prints a path the way a reader would type it (relative to the repository, `site-packages/...`
for an installed library), so outputs and the book never show the folders of the machine that ran them.

`predict()` and `reveal()` let a lesson ask before it tells: the learner writes a prediction in a cell (tagged
`prediction`), the notebook prints it, runs the experiment, and shows the measurement next to it.

    predict("4 layers: validation loss after the same steps?", answer, choices=("lower", "higher"))
    ...
    reveal("4 layers: validation loss after the same steps?", answer, "lower" if deeper < shallower else "higher")

`reveal_number()` does the same for a number: the learner writes it into a variable that starts as None, the
notebook measures, and the cell that reveals prints the measurement (always on a line `measured: <value>`), the
prediction with its relative error, and why the two differ.

    predicted_tokens = None   # tokens per optimizer step, all ranks together
    ...
    reveal_number("tokens per optimizer step", predicted_tokens, tokens_per_step, unit="tokens",
                  explain="micro-batch x accumulation steps x world size x seq_len")
"""

from __future__ import annotations

import math
import numbers
import site
import sysconfig
import traceback
from contextlib import contextmanager
from pathlib import Path


def repo_root(start: str | Path | None = None) -> Path:
    """The folder holding config/config.json: start (default cwd), its parents, or course_lib's parent."""
    here = Path(start or Path.cwd()).resolve()
    package_parent = Path(__file__).resolve().parents[1]
    for candidate in (here, *here.parents, package_parent):
        if (candidate / "config" / "config.json").is_file():
            return candidate
    return here


def _repositories() -> set[Path]:
    """The repository of this course_lib, and the one the notebook runs in when that is another copy (the book's
    build runs the notebooks in a staged copy of the repository)."""
    found = {repo_root(Path(__file__).resolve().parents[1])}
    here = repo_root()
    if (here / "config" / "config.json").is_file():
        found.add(here)
    return found


def _machine_prefixes() -> list[tuple[str, str]]:
    """(folder + "/", what a reader sees instead): installed code first (a virtual environment may live inside
    the repository), the most specific folder first, then the repositories and the home folder."""
    libraries = {Path(p) for p in (*site.getsitepackages(), site.getusersitepackages(),
                                   sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]) if p}
    prefixes = [(f"{folder}/", "site-packages/" if "packages" in folder.name else "python/")
                for folder in sorted(libraries, key=lambda p: len(str(p)), reverse=True)]
    prefixes += [(f"{folder}/", "") for folder in sorted(_repositories(), key=lambda p: len(str(p)), reverse=True)]
    if Path.home() != Path("/"):
        prefixes.append((f"{Path.home()}/", "~/"))
    return prefixes


def relative_paths(text: str) -> str:
    """`text` (an error message, a traceback, a command) with every folder of this machine written as a reader
    would type it: relative to the repository, `site-packages/...`, `python/...` (standard library), `~/...`."""
    for prefix, replacement in _machine_prefixes():
        text = text.replace(prefix, replacement)
    return text


def shown(path: str | Path) -> str:
    """`path` as a reader would type it (see relative_paths); "." for the repository itself."""
    try:
        resolved = Path(path).resolve()
    except OSError:
        return str(path)
    if resolved in _repositories():
        return "."
    return relative_paths(str(resolved))


@contextmanager
def expect_error(*error_types: type[BaseException]):
    """Catch and print the error the block raises (of error_types, default any Exception)."""
    try:
        yield
    except error_types or Exception as err:
        frames = traceback.extract_tb(err.__traceback__)[1:]  # drop this context manager's own frame
        for frame in frames:
            if "ipykernel_" in frame.filename or frame.filename.startswith("<"):
                frame.filename = "<notebook cell>"  # the kernel keeps each cell's code in a temporary file
            else:
                frame.filename = shown(frame.filename)
        print("Traceback (most recent call last):")
        print("".join(traceback.format_list(frames[-6:])), end="")
        print(f"{type(err).__name__}: {relative_paths(str(err))}")
    else:
        print("no error was raised")


def predict(question: str, answer, choices: tuple[str, ...]) -> None:
    """Note the learner's prediction before the notebook shows the answer (labs ask before they tell).

    answer: what the learner wrote in the cell (None: not written yet, which papermill runs leave as is).
    """
    if answer is None:
        print(f"{question}\n  no prediction written: write one of {', '.join(map(repr, choices))} above, then run on")
        return
    if answer not in choices:
        raise ValueError(f"{question}: predict one of {', '.join(map(repr, choices))}, got {answer!r}")
    print(f"{question}\n  your prediction: {answer!r}")


def reveal(question: str, answer, measured) -> None:
    """Print what was measured next to the learner's prediction (from predict)."""
    verdict = "" if answer is None else f"; you predicted {answer!r}: " + ("right" if answer == measured else
                                                                            "not this time, read on for why")
    print(f"{question}\n  measured: {measured!r}{verdict}")


def format_number(value) -> str:
    """A measurement as reveal_number prints it: whole numbers with thousands separators, others to 3 significant
    digits (and no exponent from 100 up)."""
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def reveal_number(question: str, predicted, measured, unit: str = "", explain: str = "") -> None:
    """Print a measured number next to the learner's prediction of it (None: no prediction written).

    Prints the question, a line `measured: <value> <unit>`, the prediction with how far it is from the
    measurement (relative error and ratio), then `explain`: why the two may differ.
    """
    if predicted is not None and (isinstance(predicted, bool) or not isinstance(predicted, numbers.Real)):
        raise ValueError(f"{question}: predict a number, got {predicted!r}")
    suffix = unit if unit in ("", "x", "%") else f" {unit}"
    lines = [question, f"  measured: {format_number(measured)}{suffix}"]
    if predicted is None:
        lines.append("  no prediction written: write a number in the prediction cell above, then run this cell again")
    else:
        predicted, measured = float(predicted), float(measured)
        if predicted == measured:
            closeness = "exactly the measured value"
        elif measured == 0:
            closeness = f"{format_number(abs(predicted))}{suffix} {'above' if predicted > 0 else 'below'} the measured 0"
        else:
            error = (predicted - measured) / abs(measured)
            ratio = f"; prediction / measured = {predicted / measured:.3g}" if predicted != 0 else ""
            closeness = (f"within 1% of the measured value{ratio}" if abs(error) < 0.01 else
                         f"{abs(error):.0%} {'above' if error > 0 else 'below'} the measured value{ratio}")
        lines.append(f"  your prediction: {format_number(predicted)}{suffix}, {closeness}")
    if explain:
        lines.append(f"  why: {explain}")
    print("\n".join(lines))

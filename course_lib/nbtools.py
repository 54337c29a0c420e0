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

`predict()` and `reveal()` let a lab ask before it tells: the learner writes a prediction in a cell, the
notebook prints it, runs the experiment, and shows the measurement next to it.

    predict("4 layers: validation loss after the same steps?", answer, choices=("lower", "higher"))
    ...
    reveal("4 layers: validation loss after the same steps?", answer, "lower" if deeper < shallower else "higher")
"""

from __future__ import annotations

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


def _library_folders() -> list[Path]:
    folders = {Path(p) for p in (*site.getsitepackages(), site.getusersitepackages(),
                                 sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]) if p}
    return sorted(folders, key=lambda p: len(str(p)), reverse=True)  # the most specific folder first


def shown(path: str | Path) -> str:
    """`path` as a reader would type it: relative to the repository when inside it, `site-packages/torch/...`
    (or `python/...` for the standard library) for installed code, `~/...` under the home folder, else as given.
    """
    raw = Path(path)
    try:
        resolved = raw.resolve()
    except OSError:
        return str(raw)
    for folder in _library_folders():  # first: a virtual environment may live inside the repository
        if folder in resolved.parents:
            label = "site-packages" if "packages" in folder.name else "python"
            return f"{label}/{resolved.relative_to(folder)}"
    root = repo_root(Path(__file__).resolve().parents[1])
    if resolved == root or root in resolved.parents:
        return str(resolved.relative_to(root)) or "."
    home = Path.home()
    if home != Path("/") and home in resolved.parents:
        return f"~/{resolved.relative_to(home)}"
    return str(raw)


def relative_paths(text: str) -> str:
    """`text` with every folder of this machine written as `shown` writes it (an error message, a traceback)."""
    for folder in _library_folders():
        label = "site-packages" if "packages" in folder.name else "python"
        text = text.replace(f"{folder}/", f"{label}/")
    root = repo_root(Path(__file__).resolve().parents[1])
    text = text.replace(f"{root}/", "")
    home = Path.home()
    return text.replace(f"{home}/", "~/") if home != Path("/") else text


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

"""What a reader must never see in a notebook's outputs or the built book: the folders of the machine that ran
it (its repository, its home, its temporary folders), stderr (warnings, progress bars, stray logging) that nobody
chose to show, and a lesson shown without the outputs its text talks about.

    output_problems(executed_notebook, forbidden, allowed)   # tests/course/test_notebooks.py, after each run
    html_problems(html_dir, forbidden)                       # scripts/build_book.py, after every build
    notebook_page_problems(html_dir, source_dir, forbidden)  # scripts/build_book.py, after every build

`forbidden` holds the absolute folders of this machine (the repository, the home folder, a run's temporary
folder). Outputs are also searched for paths in the machine's temporary folder (`tempfile.gettempdir()`) and for
the folders of course_lib.runtime.spawn's copies of notebook functions, wherever they are (temporary_paths);
`allowed` exempts folders a test passes as a notebook's own out_dir. Print paths with
`course_lib.nbtools.shown(path)`; a cell that shows stderr on purpose carries the tag `show-stderr` (and myst-nb's
`remove-stderr` drops it from the book).

A lesson notebook (one without nbgrader grade cells) is shown executed: in a build that executes the notebooks,
its page must show the outputs of its code cells. Graded exercise notebooks are shown as the unexecuted student
skeleton and are exempt.
"""

from __future__ import annotations

import html
import json
import re
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

SHOW_STDERR = "show-stderr"
STDERR_IN_HTML = re.compile(r'<div class="output stderr', re.IGNORECASE)
SPAWN_FOLDER_PREFIX = "course-notebook-functions-"  # course_lib.runtime.spawn: the modules ranks import
_PATH_CHARS = r"[^\s'\"<>()\[\]{},;]"


def machine_folders(*extra: str | Path) -> list[str]:
    """The repository and home folders of this machine, and any extra ones (a temporary folder of the run)."""
    root = Path(__file__).resolve().parents[1]
    folders = {str(root), str(Path.home()), *(str(Path(e)) for e in extra)}
    return sorted((f for f in folders if f not in ("/", "")), key=len, reverse=True)


def temporary_paths(text: str, allowed: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Paths in `text` inside this machine's temporary folder, and any folder of course_lib.runtime.spawn's copies
    of notebook functions (wherever the temporary folder is); paths under an `allowed` folder do not count."""
    for folder in sorted((str(a) for a in allowed), key=len, reverse=True):
        text = text.replace(folder, "<allowed>")
    temp = re.escape(tempfile.gettempdir().rstrip("/"))
    # The path around a spawn folder's name is found by anchoring on the name (a leading `[^...]*` would try
    # every start of a long run of path characters again: quadratic time).
    pattern = re.compile(rf"{temp}/{_PATH_CHARS}+|{SPAWN_FOLDER_PREFIX}")
    before, after = re.compile(rf"{_PATH_CHARS}*$"), re.compile(rf"{_PATH_CHARS}*")
    found = []
    for match in pattern.finditer(text):
        if match.group() != SPAWN_FOLDER_PREFIX:
            found.append(match.group())
            continue
        start = match.start() - len(before.search(text[max(0, match.start() - 4096):match.start()]).group())
        found.append(text[start:after.match(text, match.end()).end()])
    return found


def _output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    # What a reader sees as text: images (base64) hold no path, and scanning them is slow.
    return json.dumps({kind: value for kind, value in output.get("data", {}).items()
                       if kind.startswith("text/") or kind.endswith("json")})


def output_problems(nb, forbidden: list[str], allowed: list[str] | tuple[str, ...] = ()) -> list[str]:
    """One line per output that shows a forbidden folder, a temporary path outside the `allowed` folders, or
    unchosen stderr: 'cell N: ...'."""
    problems = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = set(cell.metadata.get("tags", []))
        for output in cell.get("outputs", []):
            text = _output_text(output)
            if output.get("output_type") == "stream" and output.get("name") == "stderr" and not (
                    tags & {SHOW_STDERR, "remove-stderr"}):
                first = text.strip().splitlines()[0][:120] if text.strip() else ""
                problems.append(f"cell {index}: stderr output (tag the cell {SHOW_STDERR!r} if it is meant to be "
                                f"seen): {first}")
            for folder in forbidden:
                if folder in text:
                    at = text.index(folder)
                    problems.append(f"cell {index}: shows the machine's folder {folder}: "
                                    f"...{text[max(0, at - 40):at + len(folder) + 40]!r}... "
                                    "(print it with course_lib.nbtools.shown)")
                    break
            else:
                temporary = temporary_paths(text, allowed)
                if temporary:
                    problems.append(f"cell {index}: shows a temporary path of the machine: {temporary[0]!r}")
    return problems


def html_problems(html_dir: Path, forbidden: list[str]) -> list[str]:
    """One line per built page that shows a forbidden folder or a stderr output box."""
    problems = []
    for page in sorted(Path(html_dir).rglob("*.html")):
        if "_static" in page.parts or "_sources" in page.parts:
            continue
        text = html.unescape(page.read_text(encoding="utf-8", errors="replace"))
        name = page.relative_to(html_dir)
        boxes = len(STDERR_IN_HTML.findall(text))
        if boxes:
            problems.append(f"{name}: {boxes} stderr output box(es)")
        for folder in forbidden:
            if folder in text:
                at = text.index(folder)
                problems.append(f"{name}: shows the machine's folder {folder}: "
                                f"...{text[max(0, at - 60):at + len(folder) + 40]!r}...")
                break
    return problems


@dataclass
class PageCell:
    """A code cell as a built page shows it: how many output areas, and their text."""

    outputs: int = 0
    output_text: list[str] = field(default_factory=list)


class _CellParser(HTMLParser):
    """The code cells of a myst-nb page: <div class="cell ..."> holding <div class="cell_input ..."> and, when it
    has outputs, <div class="cell_output ...">."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.cells: list[PageCell] = []
        self._divs: list[set[str]] = []
        self._in_output = 0

    def handle_starttag(self, tag, attrs):
        if tag != "div":
            return
        classes = set((dict(attrs).get("class") or "").split())
        self._divs.append(classes)
        if "cell" in classes:
            self.cells.append(PageCell())
        elif "cell_output" in classes and self.cells:
            self.cells[-1].outputs += 1
            self.cells[-1].output_text.append("")
            self._in_output += 1

    def handle_endtag(self, tag):
        if tag == "div" and self._divs and "cell_output" in self._divs.pop() and self._in_output:
            self._in_output -= 1

    def handle_data(self, data):
        if self._in_output and self.cells:
            self.cells[-1].output_text[-1] += data


def page_cells(page_html: str) -> list[PageCell]:
    """The code cells of a built notebook page, in order."""
    parser = _CellParser()
    parser.feed(page_html)
    return parser.cells


def is_graded(notebook_path: Path) -> bool:
    """True for a notebook with nbgrader grade cells (an exercise notebook, shown unexecuted)."""
    cells = json.loads(Path(notebook_path).read_text(encoding="utf-8")).get("cells", [])
    return any(cell.get("metadata", {}).get("nbgrader", {}).get("grade") for cell in cells)


def notebook_page_problems(html_dir: Path, source_dir: Path, forbidden: list[str], executed: bool = True,
                           executed_around_answers: tuple[str, ...] | list[str] = ()) -> list[str]:
    """One line per built notebook page that a reader should not see so: a lesson notebook (no grade cells) whose
    code cells show no output at all (only when `executed`: the build ran the notebooks); a code cell of a notebook
    of `executed_around_answers` (paths relative to `source_dir`: graded notebooks executed with their answers and
    tests skipped) that shows nothing although it is neither an answer, a test, the parameters nor the setup; and
    any output showing a forbidden folder or a temporary path. Pages are matched to their notebooks by path:
    <html_dir>/notebooks/x/y.html is <source_dir>/notebooks/x/y.ipynb."""
    html_dir, source_dir = Path(html_dir), Path(source_dir)
    around = {Path(name).with_suffix("") for name in executed_around_answers}
    problems = []
    for page in sorted(html_dir.rglob("*.html")):
        if "_static" in page.parts or "_sources" in page.parts:
            continue
        name = page.relative_to(html_dir)
        notebook = source_dir / name.with_suffix(".ipynb")
        if not notebook.is_file():
            continue
        cells = page_cells(page.read_text(encoding="utf-8", errors="replace"))
        if executed and cells and not is_graded(notebook) and not any(cell.outputs for cell in cells):
            problems.append(f"{name}: a lesson notebook whose {len(cells)} code cells show no output (it was not "
                            "executed; graded notebooks are the ones listed under execute: exclude_patterns)")
        if executed and name.with_suffix("") in around:
            problems += [f"{name}: {problem}" for problem in silent_lesson_cells(notebook, cells)]
        for index, cell in enumerate(cells):
            text = "\n".join(cell.output_text)
            shown = [folder for folder in forbidden if folder in text] or temporary_paths(text)
            if shown:
                problems.append(f"{name}: code cell {index} shows a folder of the machine: {shown[0]!r}")
    return problems


def shows_something(cell: dict) -> bool:
    """A code cell that is not an answer, a test, the parameters or the setup: one the reader should see run."""
    meta = cell.get("metadata", {})
    grading = meta.get("nbgrader", {})
    return not (grading.get("solution") or grading.get("grade") or grading.get("grade_id") == "setup"
                or "parameters" in meta.get("tags", []))


def silent_lesson_cells(notebook_path: Path, cells: list) -> list[str]:
    """Problems of a graded notebook executed around its answers: its page's code cells are not its code cells,
    or one that should show something shows nothing."""
    code = [cell for cell in json.loads(Path(notebook_path).read_text(encoding="utf-8"))["cells"]
            if cell["cell_type"] == "code"]
    if len(code) != len(cells):
        return [f"the page shows {len(cells)} code cells, the notebook has {len(code)}"]
    return [f"code cell {index} shows no output, although it is not an answer, a test, the parameters or the "
            f"setup (was it executed?): {''.join(cell['source'])[:60]!r}"
            for index, (cell, shown) in enumerate(zip(code, cells)) if shows_something(cell) and not shown.outputs]

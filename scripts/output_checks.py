"""What a reader must never see in a notebook's outputs or the built book: the folders of the machine that ran
it, and stderr (warnings, progress bars, stray logging) that nobody chose to show.

    output_problems(executed_notebook, forbidden)   # tests/course/test_notebooks.py, after each run
    html_problems(html_dir, forbidden)              # scripts/build_book.py, after every build

`forbidden` holds the absolute folders of this machine (the repository, the home folder, a run's temporary
folder). Print paths with `course_lib.nbtools.shown(path)`; a cell that shows stderr on purpose carries the tag
`show-stderr` (and myst-nb's `remove-stderr` drops it from the book).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

SHOW_STDERR = "show-stderr"
STDERR_IN_HTML = re.compile(r'<div class="output stderr', re.IGNORECASE)


def machine_folders(*extra: str | Path) -> list[str]:
    """The repository and home folders of this machine, and any extra ones (a temporary folder of the run)."""
    root = Path(__file__).resolve().parents[1]
    folders = {str(root), str(Path.home()), *(str(Path(e)) for e in extra)}
    return sorted((f for f in folders if f not in ("/", "")), key=len, reverse=True)


def _output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    return json.dumps(output.get("data", {}))


def output_problems(nb, forbidden: list[str]) -> list[str]:
    """One line per output that shows a forbidden folder or unchosen stderr: 'cell N: ...'."""
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

"""Build the course book (Jupyter Book 1) offline, with every Sphinx warning an error.

    .venv/bin/python scripts/build_book.py                 # execute the notebooks (cached), build _build/html
    .venv/bin/python scripts/build_book.py --no-execute    # render notebooks as stored: fast, for tests
    .venv/bin/python scripts/build_book.py --path /tmp/copy --out /tmp/book --no-execute

`make book` runs the first line. Notebooks are executed as _config.yml says (`execute_notebooks: cache`:
once, then re-used from <out>/_build/.jupyter_cache until their code changes); the graded exercise
notebooks listed under `execute: exclude_patterns` are shown unexecuted, except those of
EXECUTED_AROUND_ANSWERS (the debugging labs, whose symptoms are what a reader must see): an executed build
works on a staged copy of the book's sources in which those notebooks are executed with their answer and test
cells tagged `skip-execution` (the committed notebooks keep no such tag: nbgrader would skip them too). After
Sphinx, every page is checked for <script src> / <link href> pointing off the machine, for the folders of the machine that built
it and for stderr output boxes, every notebook page's outputs for those folders and temporary paths, and, in
an executed build, every lesson notebook (one without graded cells) for outputs: a lesson page whose code
cells show none fails the build, and so does a code cell of EXECUTED_AROUND_ANSWERS that is neither an answer,
a test, the parameters nor the setup and shows nothing (scripts/output_checks.py). The vendored MathJax must be there.
Before the checks, the session slides (scripts/build_slides.py, from book/slides/) go into <out>/_build/html/slides/,
where each session's chapter links its deck. Exits non-zero if anything fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import yaml
from build_slides import SlideBuildError, build_all as build_slide_decks
from output_checks import html_problems, machine_folders, notebook_page_problems

REPO_ROOT = Path(__file__).resolve().parent.parent
MATHJAX_IN_OUTPUT = Path("_static") / "mathjax" / "tex-chtml.js"
# -W: warnings are errors; -n: nit-picky, unresolved references warn (and so fail);
# --keep-going: report every warning, then fail; --all: re-read every page, so a warning in a page that
# did not change since the last build is reported again instead of hidden by Sphinx's incremental build.
JB_FLAGS = ["-W", "-n", "--keep-going", "--all"]
# Graded notebooks the book shows executed around their answers: every cell but the answers and their tests runs.
EXECUTED_AROUND_ANSWERS = (
    "notebooks/session_c/06_debugging_lab.ipynb",
    "notebooks/session_c/07_debugging_lab_silent.ipynb",
)
SKIP_TAG = "skip-execution"  # nbclient (and so jupyter-cache and myst-nb) runs no cell with this tag
# Not copied into the staged sources: version control, environments, builds, caches.
STAGE_SKIPPED_AT_ROOT = {".git", ".venv", "_build", ".pytest_cache", "workspace"}
STAGE_SKIPPED_ANYWHERE = {"__pycache__", ".ipynb_checkpoints"}


def toc_files(toc: dict) -> list[str]:
    """Every `file:` entry of a jb-book _toc.yml, in reading order (root first)."""
    found = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                found.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))
            for sub in entry.get("subtrees", []) or []:
                walk(sub.get("entries"))

    walk(toc.get("parts"))
    walk(toc.get("chapters"))
    return found


def source_of(source_dir: Path, docname: str) -> Path | None:
    """The file a TOC entry names (entries have no suffix), or None if there is none."""
    for suffix in ("", ".md", ".ipynb", ".rst"):
        candidate = source_dir / f"{docname}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def missing_toc_files(source_dir: Path) -> list[str]:
    toc = yaml.safe_load((source_dir / "_toc.yml").read_text(encoding="utf-8"))
    return [name for name in toc_files(toc) if source_of(source_dir, name) is None]


class _RemoteAssetFinder(HTMLParser):
    """Collects <script src=...> and <link href=...> that point to another host."""

    def __init__(self):
        super().__init__()
        self.remote: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        url = attrs.get("src") if tag == "script" else attrs.get("href") if tag == "link" else None
        if url and url.strip().lower().startswith(("http:", "https:", "//")):
            self.remote.append(f"<{tag}> {url}")


def remote_assets(html_dir: Path) -> dict[str, list[str]]:
    """{page: [remote script/stylesheet urls]} for every HTML page of the build."""
    found = {}
    for page in sorted(html_dir.rglob("*.html")):
        finder = _RemoteAssetFinder()
        finder.feed(page.read_text(encoding="utf-8", errors="replace"))
        if finder.remote:
            found[str(page.relative_to(html_dir))] = finder.remote
    return found


def config_without_execution(source_dir: Path, scratch: Path) -> Path:
    """A copy of _config.yml with notebook execution off (passed to jupyter-book with --config)."""
    config = yaml.safe_load((source_dir / "_config.yml").read_text(encoding="utf-8"))
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    path = scratch / "_config_no_execute.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def is_answer_or_test(cell: dict) -> bool:
    """An nbgrader answer cell (solution) or test cell (grade) of a student notebook."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("solution") or meta.get("grade"))


def stage_sources(source_dir: Path, staged: Path, out_dir: Path | None = None) -> Path:
    """Copy the book's sources to `staged` for an executed build: the notebooks of EXECUTED_AROUND_ANSWERS leave
    `execute: exclude_patterns` and their answer and test cells get the SKIP_TAG tag. Nothing in `source_dir` is
    changed; a notebook of EXECUTED_AROUND_ANSWERS that the sources lack is skipped. Returns `staged`."""
    source_dir = source_dir.resolve()
    out_dir = out_dir.resolve() if out_dir is not None else None

    def skipped(folder: str, names: list[str]) -> set[str]:
        here = Path(folder).resolve()
        found = {name for name in names if name in STAGE_SKIPPED_ANYWHERE}
        if here == source_dir:
            found |= {name for name in names if name in STAGE_SKIPPED_AT_ROOT}
        return found | {name for name in names if out_dir is not None and here / name == out_dir}

    shutil.copytree(source_dir, staged, ignore=skipped, symlinks=True)
    config_path = staged / "_config.yml"
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    execute = config.setdefault("execute", {})
    execute["exclude_patterns"] = [pattern for pattern in execute.get("exclude_patterns") or []
                                   if pattern not in EXECUTED_AROUND_ANSWERS]
    config_path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8")
    for name in EXECUTED_AROUND_ANSWERS:
        path = staged / name
        if not path.is_file():  # another book (--path) without the course's labs
            continue
        notebook = json.loads(path.read_text(encoding="utf-8"))
        for cell in notebook["cells"]:
            if cell["cell_type"] == "code" and is_answer_or_test(cell):
                tags = cell.setdefault("metadata", {}).setdefault("tags", [])
                if SKIP_TAG not in tags:
                    tags.append(SKIP_TAG)
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return staged


def jupyter_book_command() -> list[str]:
    """The jupyter-book of the interpreter running this script (the course .venv under `make book`)."""
    beside = Path(sys.executable).parent / "jupyter-book"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("jupyter-book")
    if found is None:
        sys.exit("jupyter-book is not installed in this environment: run `make venv` (or `make book`)")
    return [found]


def build(source_dir: Path, out_dir: Path, execute: bool) -> int:
    source_dir, out_dir = source_dir.resolve(), out_dir.resolve()
    for required in ("_config.yml", "_toc.yml"):
        if not (source_dir / required).is_file():
            print(f"error: {source_dir / required} not found (--path must be the book's root)", file=sys.stderr)
            return 2
    missing = missing_toc_files(source_dir)
    if missing:
        print(f"error: _toc.yml lists files that do not exist in {source_dir}: {missing}", file=sys.stderr)
        return 2

    # The notebook kernel must be this environment's Python: put its bin/ first on PATH.
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # keeps the kernel's debugger notice off stderr

    with tempfile.TemporaryDirectory(prefix="book-sources-") as scratch:
        # An executed build runs the notebooks in a staged copy of the sources (see stage_sources).
        book_dir = stage_sources(source_dir, Path(scratch) / "book", out_dir) if execute else source_dir
        command = [*jupyter_book_command(), "build", str(book_dir), "--path-output", str(out_dir), *JB_FLAGS]
        if not execute:
            command += ["--config", str(config_without_execution(source_dir, Path(scratch)))]
        print("+", " ".join(command), flush=True)
        status = subprocess.run(command, cwd=book_dir, env=env).returncode
        if status != 0:
            print(f"error: jupyter-book build failed (exit code {status}); the warnings above say why",
                  file=sys.stderr)
            return status
        status = build_slides(source_dir, out_dir / "_build" / "html")
        if status != 0:
            return status
        return check_output(source_dir, book_dir, out_dir, execute)


def build_slides(source_dir: Path, html_dir: Path) -> int:
    """The session slides (book/slides/session_*.md) into html_dir/slides; 0 if built, or if the book has none."""
    slides = source_dir / "book" / "slides"
    if not slides.is_dir():  # another book (--path) without slides
        return 0
    try:
        build_slide_decks(slides, html_dir / "slides", source_dir / "book" / "_static")
    except SlideBuildError as error:
        print(f"error: the slides: {error}", file=sys.stderr)
        return 1
    return 0


def check_output(source_dir: Path, book_dir: Path, out_dir: Path, execute: bool) -> int:
    """Exit status of the checks of a finished build (0: the book is as a reader should see it)."""
    html_dir = out_dir / "_build" / "html"
    problems = []
    if not (html_dir / "index.html").is_file():
        problems.append(f"{html_dir / 'index.html'} was not produced")
    if not (html_dir / MATHJAX_IN_OUTPUT).is_file():
        problems.append(f"the vendored MathJax {html_dir / MATHJAX_IN_OUTPUT} is missing")
    for page, urls in remote_assets(html_dir).items():
        problems.append(f"{page} loads from the network: {', '.join(urls)}")
    folders = machine_folders(source_dir, book_dir)
    problems += html_problems(html_dir, folders)
    problems += notebook_page_problems(html_dir, book_dir, folders, executed=execute,
                                       executed_around_answers=EXECUTED_AROUND_ANSWERS if execute else ())
    if problems:
        print("error: the book is not self-contained or not as a reader should see it:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    print(f"Book ready: {(html_dir / 'index.html').as_uri()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=REPO_ROOT,
                        help="book root holding _config.yml and _toc.yml (default: the repository)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output root; the HTML goes to OUT/_build/html (default: the book root)")
    parser.add_argument("--no-execute", action="store_true",
                        help="do not execute notebooks: render them with the outputs they are stored with")
    args = parser.parse_args(argv)
    return build(args.path, args.out or args.path, execute=not args.no_execute)


if __name__ == "__main__":
    sys.exit(main())

"""The course book builds offline with warnings as errors, and shows students no solution.

    .venv/bin/python -m pytest -q tests/course/test_book.py

The build runs once per test session, into a temporary folder, WITHOUT executing notebooks
(scripts/build_book.py --no-execute): `make book` executes them, and the notebook tests execute each
one elsewhere, so this test stays fast. COURSE_BOOK_SOURCE=<folder> builds another copy of the book.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import build_book  # scripts/ is on sys.path (tests/conftest.py)
import nbformat
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(os.environ.get("COURSE_BOOK_SOURCE", REPO_ROOT)).resolve()
# Every instructor notebook with solution regions: the graded ones.
GRADED_SOURCES = sorted(path for path in (SOURCE / "solutions").glob("*/*.ipynb")
                        if "### BEGIN SOLUTION" in path.read_text(encoding="utf-8"))
SOLUTION_REGION = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN_TESTS_REGION = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
NBGRADER_MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
# A line shorter than this is too common to be evidence of a leak: `return x`, `B, T = idx.shape` in solutions,
# `with torch.no_grad():` in hidden tests (which a lesson may well contain too).
MIN_LEAK_CHARS = {SOLUTION_REGION: 20, HIDDEN_TESTS_REGION: 40}
# On other pages (a lesson may well loop `for rank in range(world_size):`), only longer solution lines count.
MIN_CROSS_PAGE_LEAK_CHARS = 32
MIN_GLOSSARY_TERMS = 30

pytestmark = pytest.mark.slow


class _PageText(HTMLParser):
    """The text of a page as a reader sees it (tags dropped, entities decoded, scripts and styles skipped),
    and the ids it defines."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def read_page(path: Path) -> _PageText:
    page = _PageText()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(html folder, build output) of one --no-execute build of the book."""
    out = tmp_path_factory.mktemp("book")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "build_book.py"), "--no-execute", "--path", str(SOURCE),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    return out / "_build" / "html", result


@pytest.fixture(scope="module")
def html_dir(built):
    html, result = built
    if result.returncode != 0:
        output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)  # drop terminal colours
        warnings = [line for line in output.splitlines()
                    if "WARNING" in line or "ERROR" in line or line.startswith("error")]
        pytest.fail("the book build failed (warnings are errors):\n" + "\n".join(warnings[-30:] or
                                                                               [result.stderr[-3000:]]))
    return html


@pytest.fixture(scope="module")
def pages(html_dir):
    """{path relative to the html folder: parsed page} for every page of the book."""
    return {str(p.relative_to(html_dir)): read_page(p) for p in sorted(html_dir.rglob("*.html"))}


def toc_docnames() -> list[str]:
    toc = yaml.safe_load((SOURCE / "_toc.yml").read_text(encoding="utf-8"))
    return build_book.toc_files(toc)


def notebook_docnames() -> list[str]:
    return [name for name in toc_docnames() if build_book.source_of(SOURCE, name).suffix == ".ipynb"]


def test_build_succeeds_with_warnings_as_errors(built, html_dir):
    _, result = built
    assert "Book ready: file://" in result.stdout
    assert (html_dir / "index.html").is_file()


def test_every_toc_page_is_built(html_dir):
    missing = [name for name in toc_docnames() if not (html_dir / f"{name}.html").is_file()]
    assert not missing, f"pages listed in _toc.yml without HTML output: {missing}"


def test_book_uses_graded_notebooks_from_notebooks_not_solutions():
    offenders = [name for name in toc_docnames() if name.split("/")[0] in ("solutions", "source", "submitted")]
    assert not offenders, f"_toc.yml must list student notebooks from notebooks/, not {offenders}"


def test_nothing_is_loaded_from_the_network(html_dir):
    remote = build_book.remote_assets(html_dir)
    assert not remote, f"pages load scripts or stylesheets from the network: {remote}"


def test_mathjax_is_the_vendored_copy_and_renders_the_math_pages(html_dir):
    mathjax = html_dir / "_static" / "mathjax" / "tex-chtml.js"
    assert mathjax.is_file(), "the vendored MathJax was not copied into the build"
    assert (html_dir / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()
    page = html_dir / "book" / "session_a" / "index.html"
    html = page.read_text(encoding="utf-8")
    assert 'class="math' in html, "the Session A chapter should contain math"
    sources = re.findall(r'<script[^>]*src="([^"]*mathjax[^"]*)"', html)
    assert sources, f"{page.name} loads no MathJax"
    for src in sources:
        resolved = (page.parent / src.split("?")[0]).resolve()
        assert resolved == mathjax.resolve(), f"{page.name} loads MathJax from {src}, not the vendored copy"


def test_graded_notebooks_are_shown_unexecuted(html_dir, pages):
    graded = yaml.safe_load((SOURCE / "_config.yml").read_text(encoding="utf-8"))["execute"]["exclude_patterns"]
    assert "notebooks/session_a/02_model_from_scratch.ipynb" in graded, (
        "_config.yml must exclude the graded notebook from execution (its exercises raise NotImplementedError)")
    page = "notebooks/session_a/02_model_from_scratch.html"
    text = normalise("".join(pages[page].parts))
    assert "raise NotImplementedError" in text, "the exercise notebook should show the student skeleton"
    html = (html_dir / page).read_text(encoding="utf-8")
    assert "cell_output" not in html, "the exercise notebook should be shown without outputs"


def test_no_nbgrader_markers_in_notebook_pages(html_dir, pages):
    for name in notebook_docnames():
        text = "".join(pages[f"{name}.html"].parts)
        found = [marker for marker in NBGRADER_MARKERS if marker in text]
        assert not found, f"{name}.html contains nbgrader markers {found}: it was built from an instructor notebook"


def _regions(source: str, region: tuple[str, str]) -> tuple[list[str], str]:
    """(lines inside the region's markers, the source with those regions removed)."""
    inside, outside, in_region = [], [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(region[0]):
            in_region = True
        elif stripped.startswith(region[1]):
            in_region = False
        elif in_region:
            inside.append(line)
        else:
            outside.append(line)
    return inside, "\n".join(outside)


def solution_lines(source: Path) -> list[tuple[str, tuple[str, str]]]:
    """(line, region) of the solution and hidden-test regions that a student never sees in the notebook (nor in the
    scripts it hands over whole: the debugging labs' jobs)."""
    notebook = nbformat.read(source, as_version=4)
    hidden, visible = [], []
    for cell in notebook.cells:
        solutions, rest = _regions(cell.source, SOLUTION_REGION)
        tests, rest = _regions(rest, HIDDEN_TESTS_REGION)
        hidden += [(line, SOLUTION_REGION) for line in solutions] + [(line, HIDDEN_TESTS_REGION) for line in tests]
        visible.append(rest.replace("`", "") if cell.cell_type == "markdown" else rest)  # hints quote code
    from course_lib.debugging.jobs import script_of

    visible += [script_of(job) for job in sorted(set(re.findall(r'run_job\("(job_\d+)"', "".join(visible))))]
    visible_text = normalise("\n".join(visible))
    distinctive = []
    for line, region in hidden:
        code = normalise(line.split("  # ")[0])  # a trailing comment may be reworded; the code may not
        if len(code) >= MIN_LEAK_CHARS[region] and not code.startswith("#") and code not in visible_text:
            distinctive.append((code, region))
    return distinctive


@pytest.mark.parametrize("source", GRADED_SOURCES, ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_no_solution_code_appears_in_the_book(pages, source):
    """The notebook's own page shows none of its solution or hidden-test lines; no other page (lessons and
    chapters of every session) shows a solution line long enough to be more than common idiom."""
    lines = solution_lines(source)
    assert lines, "found no solution lines to look for: are the nbgrader markers still there?"
    own_page = f"notebooks/{source.parent.name}/{source.stem}.html"
    assert own_page in pages, f"{own_page} was not built"
    leaks = {}
    for page_name, page in pages.items():
        text = normalise("".join(page.parts))
        found = [line for line, region in lines if line in text
                 and (page_name == own_page or (region == SOLUTION_REGION and len(line) >= MIN_CROSS_PAGE_LEAK_CHARS))]
        if found:
            leaks[page_name] = found
    assert not leaks, f"solution code of {source.name} appears in the book: {leaks}"


def test_every_graded_notebook_is_checked_for_leaks():
    assert len(GRADED_SOURCES) >= 3, f"expected the graded notebooks of every session, found {GRADED_SOURCES}"


def glossary_terms() -> list[str]:
    source = (SOURCE / "book" / "glossary.md").read_text(encoding="utf-8")
    block = re.search(r"```\{glossary\}\n(.*?)\n```", source, re.S)
    assert block, "book/glossary.md has no {glossary} block"
    return [line.strip() for line in block.group(1).splitlines()
            if line.strip() and not line.startswith((" ", "\t", ":"))]


def test_glossary_defines_every_term(pages):
    terms = glossary_terms()
    assert len(terms) >= MIN_GLOSSARY_TERMS, f"the glossary defines only {len(terms)} terms"
    ids = pages["book/glossary.html"].ids
    term_ids = {i for i in ids if i.startswith("term-")}
    assert len(term_ids) == len(terms), f"{len(terms)} terms in glossary.md, {len(term_ids)} in glossary.html"


def test_every_glossary_link_resolves(html_dir, pages):
    glossary_ids = pages["book/glossary.html"].ids
    links, broken = 0, []
    for page_name, page in pages.items():
        for href in page.hrefs:
            target, _, anchor = href.partition("#")
            if not anchor.startswith("term-"):
                continue
            links += 1
            resolved = (html_dir / page_name).parent / target if target else html_dir / page_name
            if resolved.resolve() != (html_dir / "book" / "glossary.html").resolve() or anchor not in glossary_ids:
                broken.append(f"{page_name}: {href}")
    assert links >= MIN_GLOSSARY_TERMS, f"only {links} links into the glossary; the chapters should use {{term}}"
    assert not broken, f"glossary links that lead nowhere: {broken}"


@pytest.mark.parametrize("session", "abcdef")
def test_every_session_gives_instructors_a_90_minute_class_of_its_own_notebooks(session):
    """Seed 003 plans 90-minute sessions: each chapter says what to do in class and what is homework."""
    chapter = (SOURCE / "book" / f"session_{session}" / "index.md").read_text(encoding="utf-8")
    assert "## A 90-minute class" in chapter
    plan = chapter.split("## A 90-minute class", 1)[1].split("\n## ", 1)[0]
    notebooks = {p.stem for p in (SOURCE / "notebooks" / f"session_{session}").glob("*.ipynb")}
    named = set(re.findall(r"`(\d\db?_\w+)`", plan))
    assert named and named <= notebooks, f"the plan names notebooks that do not exist: {sorted(named - notebooks)}"
    minutes = [int(m) for m in re.findall(r"^\| \d+–(\d+) \|", plan, re.M)]
    assert minutes and minutes[-1] == 90 and minutes == sorted(minutes), minutes
    assert "Homework:" in plan

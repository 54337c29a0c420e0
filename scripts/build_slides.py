"""Build the slide deck of every session (reveal.js, offline) from book/slides/session_<x>.md.

    .venv/bin/python scripts/build_slides.py                      # every deck into _build/html/slides/
    .venv/bin/python scripts/build_slides.py --out /tmp/slides    # somewhere else
    .venv/bin/python scripts/build_slides.py --source DIR         # the session_*.md decks of another folder

`make slides` runs the first line; `make book` (scripts/build_book.py) runs it after Sphinx, so that each session's
chapter can link its deck at _build/html/slides/session_<x>.html. Open a deck in a browser: arrow keys move, S opens
the speaker notes, F goes full screen, Esc shows every slide.

A source is markdown. A line `---` starts the next slide, a line `--` a vertical sub-slide below the current one,
and a line `Note:` starts the speaker notes of its slide (everything after it, up to the next separator). Math is
$...$ or $$...$$. Images are local files, written relative to the source (`../_static/figures/ring_vs_tree.png`,
the book's figures from scripts/make_figures.py); they are copied into OUT/figures/.

Each deck becomes an in-memory notebook with one markdown cell per slide (metadata.slideshow.slide_type `slide`,
`subslide` or `notes`), exported by nbconvert's SlidesExporter with a template that loads nothing from the network:
reveal.js from book/_static/revealjs/ and MathJax 3 from book/_static/mathjax/, both copied into OUT, so that OUT
opens from the file system. The build fails, naming the deck, when a deck has more than MAX_SLIDES slides (and
sub-slides), when it refers to the network or to a file that does not exist, or when the HTML it produced loads
anything from the network (src, href, CSS url() or @import, in the page and in the stylesheets it links).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import nbformat
from nbconvert import SlidesExporter

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIR = REPO_ROOT / "book" / "slides"
STATIC_DIR = REPO_ROOT / "book" / "_static"       # holds revealjs/ and mathjax/ (see the README.txt of each)
OUT_DIR = REPO_ROOT / "_build" / "html" / "slides"
DECK_GLOB = "session_*.md"
MAX_SLIDES = 25                                    # a 90-minute class: slides and sub-slides together
SLIDE_BREAK, SUBSLIDE_BREAK = "---", "--"
NOTES = re.compile(r"^Note:\s?(.*)$")
FENCE = re.compile(r"^\s*(```|~~~)")
VENDORED = ("revealjs", "mathjax")                 # folders of STATIC_DIR copied next to the decks
FIGURE_DIR = "figures"
REVEAL_THEME = "white"                             # the template's default, "simple", imports Google Fonts

# Images of a source: ![alt](target "title") and <img src="target">.
MARKDOWN_IMAGE = re.compile(r"!\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(\s+\"[^\"]*\")?\s*\)")
HTML_IMAGE = re.compile(r"(<img\b[^>]*?\bsrc\s*=\s*[\"'])([^\"']+)([\"'])", re.IGNORECASE)
# What must never be in a source: a URL with a scheme that reaches the network, as a link, image or attribute.
NETWORK_URL = re.compile(r"(?:\]\(\s*<?|<|\b(?:src|href)\s*=\s*[\"']?)((?:https?:)?//[^\s)\"'>]+)", re.IGNORECASE)
# In the produced HTML and its stylesheets.
CSS_URL = re.compile(r"url\(\s*([\"']?)([^\"')]+)\1\s*\)", re.IGNORECASE)
CSS_IMPORT = re.compile(r"@import\s+([\"'])([^\"']+)\1", re.IGNORECASE)
CSS_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)

# nbconvert's reveal template loads require.js, jQuery, mermaid and MathJax 2 from CDNs and reveal.js through
# require.js. This template keeps its page and replaces those blocks: MathJax 3 and reveal.js from local copies.
TEMPLATE = r"""
{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}
<script>
window.MathJax = {
  tex: {inlineMath: [['$', '$'], ['\\(', '\\)']], displayMath: [['$$', '$$'], ['\\[', '\\]']],
        processEscapes: true},
  options: {skipHtmlTags: ['script', 'noscript', 'style', 'textarea', 'pre', 'code']}
};
</script>
<script src="{{ resources.mathjax_url }}"></script>
{%- endblock html_head_js_mathjax -%}
{%- block html_head_css -%}
<style type="text/css">
:root { --jp-content-font-size1: 24px; --jp-code-font-size: 18px; }
.reveal .slides { text-align: left; }
.reveal .slides section { height: 100%; overflow-y: auto; }  /* a slide that runs long scrolls, never clips */
.reveal h1 { font-size: 1.9em; } .reveal h2 { font-size: 1.35em; } .reveal h3 { font-size: 1.1em; }
.reveal h1, .reveal h2, .reveal h3 { text-transform: none; margin: 0 0 0.4em 0; }
.reveal .jp-RenderedHTMLCommon { font-size: var(--jp-content-font-size1); line-height: 1.4; padding-right: 0; }
.reveal .jp-RenderedHTMLCommon p, .reveal .jp-RenderedHTMLCommon ul,
.reveal .jp-RenderedHTMLCommon ol { margin: 0 0 0.5em 0; }
.reveal .jp-RenderedHTMLCommon li { margin: 0.1em 0; }
.reveal .jp-RenderedHTMLCommon pre { font-size: var(--jp-code-font-size); line-height: 1.35; box-shadow: none;
  background: #f5f5f5; padding: 0.4em 0.6em; width: auto; }
.reveal .jp-RenderedHTMLCommon table { font-size: 0.8em; margin: 0.3em 0 0.6em 0; }
.reveal img { max-height: 520px; max-width: 100%; display: block; margin: 0.3em auto; }
.reveal aside.notes { display: none; }
</style>
{%- endblock html_head_css -%}
{% block footer_js %}
<script src="{{ resources.reveal.url_prefix }}/dist/reveal.js"></script>
<script src="{{ resources.reveal.url_prefix }}/plugin/notes/notes.js"></script>
<script>
Reveal.initialize({
  controls: true,
  progress: true,
  history: true,
  center: false,
  transition: "{{ resources.reveal.transition }}",
  slideNumber: "{{ resources.reveal.number }}",
  width: {{ resources.reveal.width }},
  height: {{ resources.reveal.height }},
  plugins: [RevealNotes]
});
</script>
{% endblock footer_js %}
"""


class SlideBuildError(Exception):
    """A deck that cannot be built as it is; the message names the file and says why."""


@dataclass
class Slide:
    kind: str                                    # "slide" or "subslide"
    body: str
    notes: str = ""
    line: int = 1                                # where it starts in the source, for messages


@dataclass
class Deck:
    source: Path
    title: str
    slides: list[Slide] = field(default_factory=list)
    figures: dict[str, Path] = field(default_factory=dict)   # name under OUT/figures -> source file


def parse_deck(text: str, source: Path) -> list[Slide]:
    """The slides of a source, in order. `---` and `--` inside a fenced code block separate nothing."""
    slides = [Slide("slide", "", line=1)]
    body, notes, in_notes, in_fence = [], [], False, False

    def close():
        slides[-1].body, slides[-1].notes = "\n".join(body).strip(), "\n".join(notes).strip()

    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
        stripped = line.rstrip()
        if not in_fence and stripped in (SLIDE_BREAK, SUBSLIDE_BREAK):
            close()
            slides.append(Slide("slide" if stripped == SLIDE_BREAK else "subslide", "", line=number + 1))
            body, notes, in_notes = [], [], False
            continue
        match = None if in_fence else NOTES.match(line)
        if match:
            in_notes = True
            line = match.group(1)
        (notes if in_notes else body).append(line)
    if in_fence:
        raise SlideBuildError(f"{source}: a code fence (``` or ~~~) is opened and never closed")
    close()
    if not slides[0].body and not slides[0].notes and len(slides) > 1:
        slides.pop(0)                            # a source may open with a separator
        slides[0].kind = "slide"
    empty = [slide.line for slide in slides if not slide.body]
    if empty:
        raise SlideBuildError(f"{source}: the slide starting at line {empty[0]} is empty (two separators in a row, "
                              "or speaker notes with no slide)")
    return slides


def network_urls(markdown: str) -> list[str]:
    """URLs of a source that a browser would fetch or follow over the network."""
    return [match.group(1) for match in NETWORK_URL.finditer(markdown)]


def _local_image(target: str, source: Path, deck: Deck) -> str:
    """Register a local image of the deck and return its address in the output (figures/<name>)."""
    if target.startswith("data:"):
        return target
    path = (source.parent / target.split("#")[0].split("?")[0]).resolve()
    if not path.is_file():
        raise SlideBuildError(f"{source}: image {target} does not exist (looked for {path})")
    name = path.name
    if deck.figures.get(name, path) != path:
        raise SlideBuildError(f"{source}: two different images are called {name}: {deck.figures[name]} and {path}")
    deck.figures[name] = path
    return f"{FIGURE_DIR}/{name}"


def read_deck(source: Path, max_slides: int = MAX_SLIDES) -> Deck:
    """Parse and check one source: its slides, its title (the first `# ` heading) and the images it shows."""
    text = source.read_text(encoding="utf-8")
    slides = parse_deck(text, source)
    if len(slides) > max_slides:
        raise SlideBuildError(f"{source}: {len(slides)} slides (slides and sub-slides together), more than the "
                              f"{max_slides} a 90-minute class can use; merge or cut some")
    remote = network_urls(text)
    if remote:
        raise SlideBuildError(f"{source}: refers to the network ({', '.join(remote)}); the slides must work "
                              "offline: put the file under book/_static/ and refer to it by a relative path")
    title = next((line[2:].strip() for slide in slides for line in slide.body.splitlines()
                  if line.startswith("# ")), source.stem)
    deck = Deck(source=source, title=re.sub(r"[*_`]", "", title), slides=slides)
    for slide in slides:
        slide.body = MARKDOWN_IMAGE.sub(
            lambda m: f"![{m.group(1)}]({_local_image(m.group(2), source, deck)}{m.group(3) or ''})", slide.body)
        slide.body = HTML_IMAGE.sub(
            lambda m: f"{m.group(1)}{_local_image(m.group(2), source, deck)}{m.group(3)}", slide.body)
    return deck


def deck_notebook(deck: Deck) -> nbformat.NotebookNode:
    """The deck as a notebook: one markdown cell per slide, and one `notes` cell after a slide with notes."""
    cells = []
    for number, slide in enumerate(deck.slides, start=1):
        cells.append(nbformat.v4.new_markdown_cell(slide.body, id=f"slide-{number}",
                                                   metadata={"slideshow": {"slide_type": slide.kind}}))
        if slide.notes:
            cells.append(nbformat.v4.new_markdown_cell(slide.notes, id=f"slide-{number}-notes",
                                                       metadata={"slideshow": {"slide_type": "notes"}}))
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["title"] = deck.title
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def exporter() -> SlidesExporter:
    slides = SlidesExporter()
    slides.raw_template = TEMPLATE
    slides.reveal_url_prefix = "revealjs"
    slides.reveal_theme = REVEAL_THEME
    slides.reveal_transition = "none"
    slides.reveal_number = "c/t"
    slides.reveal_width, slides.reveal_height = "1280", "720"
    slides.mathjax_url = "mathjax/tex-chtml.js"
    # Unused by TEMPLATE; emptied so that no CDN address is even written into a page.
    slides.require_js_url = slides.jquery_url = slides.font_awesome_url = ""
    slides.exclude_input_prompt = slides.exclude_output_prompt = True
    return slides


class _References(HTMLParser):
    """Every address a page loads or links (src, href, inline CSS url() and @import)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.references: list[tuple[str, str]] = []     # (what, address)
        self.stylesheets: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if attrs.get(name):
                self.references.append((f"<{tag} {name}>", attrs[name].strip()))
        if tag == "link" and "stylesheet" in (attrs.get("rel") or "") and attrs.get("href"):
            self.stylesheets.append(attrs["href"].strip())
        if attrs.get("style"):
            self.references += [("style url()", url) for url in css_references(attrs["style"])]
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.references += [("<style>", url) for url in css_references(data)]


def css_references(css: str) -> list[str]:
    """The addresses of a style sheet's url() and @import (comments left out)."""
    css = CSS_COMMENT.sub("", css)
    return [m.group(2).strip() for m in (*CSS_URL.finditer(css), *CSS_IMPORT.finditer(css))]


def is_remote(url: str) -> bool:
    return url.lower().startswith(("http:", "https:", "//", "ftp:"))


def is_local_file(url: str) -> bool:
    """An address that names a file next to the page (not data:, not an anchor, not javascript:, not mailto:)."""
    return bool(url) and not url.startswith("#") and ":" not in url.split("/")[0]


def page_problems(page: Path, root: Path) -> list[str]:
    """What is wrong with a built deck: network addresses, and local files that are not in `root`, followed through
    the stylesheets the page links."""
    parser = _References()
    parser.feed(page.read_text(encoding="utf-8"))
    problems, queue = [], [(page, what, url) for what, url in parser.references]
    seen_css = set()
    while queue:
        where, what, url = queue.pop()
        if is_remote(url):
            problems.append(f"{where.name}: {what} loads {url} from the network")
            continue
        if not is_local_file(url):
            continue
        target = (where.parent / url.split("#")[0].split("?")[0]).resolve()
        if not target.is_file() or not target.is_relative_to(root.resolve()):
            problems.append(f"{where.name}: {what} refers to {url}, which is not in {root}")
        elif target.suffix == ".css" and target not in seen_css:
            seen_css.add(target)
            queue += [(target, "url()/@import", ref) for ref in css_references(target.read_text(encoding="utf-8"))]
    return problems


def copy_vendored(static_dir: Path, out_dir: Path) -> None:
    for name in VENDORED:
        if not (static_dir / name).is_dir():
            raise SlideBuildError(f"the vendored {name} is missing: {static_dir / name} (see its README.txt)")
        shutil.rmtree(out_dir / name, ignore_errors=True)
        shutil.copytree(static_dir / name, out_dir / name, ignore=shutil.ignore_patterns("README.txt"))


def build_deck(deck: Deck, out_dir: Path, slides_exporter: SlidesExporter | None = None) -> Path:
    """Write one checked deck into out_dir (the vendored files must be there already); returns the HTML file."""
    body, _ = (slides_exporter or exporter()).from_notebook_node(deck_notebook(deck),
                                                                  resources={"metadata": {"name": deck.title}})
    (out_dir / FIGURE_DIR).mkdir(parents=True, exist_ok=True)
    for name, path in deck.figures.items():
        shutil.copyfile(path, out_dir / FIGURE_DIR / name)
    page = out_dir / f"{deck.source.stem}.html"
    page.write_text(body, encoding="utf-8")
    problems = page_problems(page, out_dir)
    if problems:
        page.unlink()
        raise SlideBuildError(f"{deck.source}: the deck built from it is not self-contained:\n  "
                              + "\n  ".join(problems))
    return page


def build_all(source_dir: Path = SOURCE_DIR, out_dir: Path = OUT_DIR, static_dir: Path = STATIC_DIR,
              max_slides: int = MAX_SLIDES) -> list[Path]:
    """Build every session_*.md of source_dir into out_dir, with reveal.js, MathJax and the figures beside them."""
    sources = sorted(source_dir.glob(DECK_GLOB))
    if not sources:
        raise SlideBuildError(f"no decks ({DECK_GLOB}) in {source_dir}")
    decks = [read_deck(source, max_slides) for source in sources]  # every source checked before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(DECK_GLOB.replace(".md", ".html")):  # decks and figures of an earlier build
        stale.unlink()
    shutil.rmtree(out_dir / FIGURE_DIR, ignore_errors=True)
    copy_vendored(static_dir, out_dir)
    slides_exporter = exporter()
    pages = [build_deck(deck, out_dir, slides_exporter) for deck in decks]
    for deck, page in zip(decks, pages):
        count = sum(slide.kind == "slide" for slide in deck.slides)
        print(f"{page.name}: {len(deck.slides)} slides ({count} + {len(deck.slides) - count} sub-slides), "
              f"{len(deck.figures)} figures - {deck.title}")
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE_DIR, help=f"folder of {DECK_GLOB} (default: book/slides)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output folder (default: _build/html/slides)")
    parser.add_argument("--static", type=Path, default=STATIC_DIR,
                        help="folder holding the vendored revealjs/ and mathjax/ (default: book/_static)")
    args = parser.parse_args(argv)
    try:
        pages = build_all(args.source, args.out, args.static)
    except SlideBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Slides ready: {pages[0].parent.resolve().as_uri()}/ ({len(pages)} decks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The session slides: one reveal.js deck per session, built offline from book/slides/ by scripts/build_slides.py.

    .venv/bin/python -m pytest -q tests/test_slides.py

The decks are built once, into a temporary folder (`build_slides.main(["--out", DIR])`, what `make slides` runs
with its default folder). The checks read the HTML as a browser would, with a parser of their own rather than
the builder's: every address a deck loads (src, href, CSS url() and @import, followed into the stylesheets it
links) must be on this machine and inside the output, and every session's deck must cover the topics the
curriculum plans for its class. Bad sources (26 slides, a network image, a missing image) must stop the build
with a message that names the file.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from html.parser import HTMLParser
from pathlib import Path

import build_slides  # scripts/ is on sys.path (tests/conftest.py)
import pytest
from nbconvert import SlidesExporter

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = REPO_ROOT / "book" / "slides"
FIGURES = REPO_ROOT / "book" / "_static" / "figures"
SESSIONS = "abcdef"
MAX_SLIDES = 25

# Topic -> phrases that must all occur (case-sensitive, whitespace normalised) in the deck's visible text, speaker
# notes excluded. A-C: the slide topics of the tutorial curriculum (seed 003); D-F: the syllabus and the chapters.
TOPICS = {
    "a": {
        "What is distributed training?": ["What is distributed training?", "rank", "collectives"],
        "Why models exceed single-device memory": ["Why models exceed single-device memory", "16 bytes", "112 GB",
                                                   "80 GB"],
        "Data vs model vs pipeline parallelism": ["data parallelism", "tensor parallelism", "model parallel",
                                                  "pipeline parallelism"],
        "Autograd and computation graph overview": ["Autograd and the computation graph", "chain rule", "saves"],
        "Forward pass, backward pass, gradient update": ["Forward pass, backward pass, gradient update",
                                                         "loss.backward()", "AdamW"],
        "Intro to training loops": ["Intro to training loops", "optimizer.step()", "checkpoint", "resume",
                                    "validation loss"],
    },
    "b": {
        "How NCCL performs all-reduce": ["How NCCL performs all-reduce", "ring", "reduce-scatter", "all-gather",
                                         "tree"],
        "What gradient buckets are": ["What gradient buckets are", "bucket_cap_mb", "asynchronously"],
        "CUDA kernels vs fused kernels": ["CUDA kernels vs fused kernels", "launch overhead", "memory traffic",
                                          "fused=True"],
        "AMP autocast & GradScaler": ["torch.autocast", "GradScaler", "scaler.scale(loss).backward()", "bf16"],
        "Gradient accumulation strategies": ["Gradient accumulation strategies", "no_sync", "micro-batch"],
        "Effective batch size and memory trade-offs": ["Effective batch size and memory trade-offs",
                                                       "activation memory", "critical batch size"],
    },
    "c": {
        "Multi-node NCCL: master address, master port": ["MASTER_ADDR", "MASTER_PORT", "rendezvous", "TCPStore"],
        "Environment variables WORLD_SIZE, NODE_RANK, RANK, LOCAL_RANK": ["WORLD_SIZE", "NODE_RANK", "LOCAL_RANK",
                                                                         "RANK", "global index"],
        "SLURM job structure": ["sbatch → allocate → srun workers → cleanup", "sbatch job.sbatch", "srun",
                                "SLURM_PROCID"],
        "Kubernetes GPU pods and device plugins": ["Kubernetes GPU pods and device plugins", "device plugin",
                                                   "nvidia.com/gpu", "gang scheduling"],
        "Checkpointing across nodes": ["Checkpointing across nodes", "manifest", "every rank writes its own part",
                                       "reshard"],
        "Distributed logging aggregation": ["Distributed logging aggregation", "all_reduce", "gather_object",
                                            "name the rank on every line"],
    },
    "d": {
        "Where memory goes": ["Where memory goes", "model states", "optimizer state", "saved_tensors_hooks"],
        "ZeRO stages 1-3": ["ZeRO-1", "ZeRO-2", "ZeRO-3", "reduce-scatter", "all-gather"],
        "FSDP": ["fully_shard", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "apply_fsdp"],
        "Mixed precision": ["MixedPrecisionPolicy", "param_dtype", "reduce_dtype", "loss scaling"],
        "Activation checkpointing": ["activation checkpointing"],
        "The memory calculator": ["memory calculator", "memory_per_gpu", "80 GB"],
    },
    "e": {
        "Tensor parallelism": ["column-parallel", "row-parallel", "apply_tensor_parallel", "ColwiseParallel"],
        "Sequence parallelism": ["Sequence parallelism", "all-gather", "reduce-scatter"],
        "Pipeline parallelism and its schedules": ["Pipeline schedules", "GPipe", "1F1B", "bubble"],
        "3D parallelism": ["3D parallelism", "init_device_mesh", "parallelize(model, layout, mesh)"],
        "LoRA": ["LoRA", "apply_lora", "merge_lora"],
        "Profiling": ["torch.profiler", "profile_steps", "MFU"],
    },
    "f": {
        "Sequence parallelism (Megatron-SP)": ["Sequence parallelism (Megatron-SP)", "reduce-scatter", "all-gather"],
        "Context parallelism: ring attention": ["Context parallelism: ring attention", "online softmax",
                                                "log-sum-exp", "zigzag"],
        "Mixture of experts, expert parallelism": ["Mixture of experts", "capacity", "load-balancing loss",
                                                   "Expert parallelism: two all-to-alls", "ExpertParallelMoE"],
        "The four dimensions together": ["The four dimensions together", "four_d_groups", "expert group"],
    },
}

# The book's figures (scripts/make_figures.py) each deck shows.
DECK_FIGURES = {
    "a": {"node_topology.png"},
    "b": {"ring_vs_tree.png"},
    "c": {"node_topology.png", "slurm_lifecycle.png", "checkpoint_interval.png"},
    "d": {"zero_memory.png", "memory_calculator.png"},
    "e": {"node_topology.png"},
}


class _Page(HTMLParser):
    """A deck as a browser sees it: its slides (innermost <section>s), visible text (notes, scripts and styles
    left out), the text of each slide, and every address it loads or links, with the stylesheets it links."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.slides: list[str] = []
        self.references: list[tuple[str, str]] = []
        self.stylesheets: list[str] = []
        self.notes = 0
        self._sections: list[dict] = []       # per open <section>: has a child section, its text
        self._hidden = 0                      # inside <script>, <style> or <aside class="notes">
        self._style = ""
        self._anchor = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if attrs.get(name):
                self.references.append((f"<{tag} {name}>", attrs[name].strip()))
        if tag == "link" and "stylesheet" in (attrs.get("rel") or "") and attrs.get("href"):
            self.stylesheets.append(attrs["href"].strip())
        if attrs.get("style"):
            self.references += [("style attribute", url) for url in css_addresses(attrs["style"])]
        if tag == "section":
            if self._sections:
                self._sections[-1]["parent"] = True
            self._sections.append({"parent": False, "text": []})
        if tag in ("script", "style") or (tag == "aside" and "notes" in (attrs.get("class") or "")):
            self._hidden += 1
            self.notes += tag == "aside"
        if tag == "a" and "anchor-link" in (attrs.get("class") or ""):  # the heading's ¶, hidden by the CSS
            self._anchor = True

    def handle_endtag(self, tag):
        if tag == "section" and self._sections:
            section = self._sections.pop()
            if not section["parent"]:
                self.slides.append(normalise("".join(section["text"])))
        if tag == "a":
            self._anchor = False
        if tag in ("script", "style", "aside") and self._hidden:
            self._hidden -= 1
            if tag == "style":
                self.references += [("<style>", url) for url in css_addresses(self._style)]
                self._style = ""

    def handle_data(self, data):
        if self.lasttag == "style" and self._hidden:
            self._style += data
        if not self._hidden and not self._anchor and self._sections:
            self._sections[-1]["text"].append(data)

    @property
    def text(self) -> str:
        return " ".join(self.slides)


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def css_addresses(css: str) -> list[str]:
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    return ([m.group(2).strip() for m in re.finditer(r"url\(\s*([\"']?)([^\"')]+)\1\s*\)", css)]
            + [m.group(2).strip() for m in re.finditer(r"@import\s+([\"'])([^\"']+)\1", css)])


def remote(url: str) -> bool:
    return bool(re.match(r"^\s*(https?:|ftp:|//)", url, re.I))


def local_file(url: str) -> bool:
    return not url.startswith(("#", "data:", "javascript:", "mailto:")) and not remote(url)


def read_page(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def every_address(page_path: Path) -> list[tuple[Path, str, str]]:
    """(file that refers, what, address) for the page and, recursively, every stylesheet it loads."""
    page = read_page(page_path)
    found = [(page_path, what, url) for what, url in page.references]
    queue, seen = [(page_path, url) for url in page.stylesheets], set()
    while queue:
        where, url = queue.pop()
        target = (where.parent / url.split("?")[0].split("#")[0]).resolve()
        if remote(url) or target in seen or not target.is_file():
            continue
        seen.add(target)
        for ref in css_addresses(target.read_text(encoding="utf-8")):
            found.append((target, "CSS", ref))
            if ref.endswith(".css"):
                queue.append((target, ref))
    return found


def notebooks_of(session: str) -> set[str]:
    return {path.stem for path in (REPO_ROOT / "notebooks" / f"session_{session}").glob("*.ipynb")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(output folder, exit status) of one build of every deck."""
    out = tmp_path_factory.mktemp("slides")
    return out, build_slides.main(["--out", str(out)])


@pytest.fixture(scope="module")
def out_dir(built):
    out, status = built
    assert status == 0, "scripts/build_slides.py failed: run it to see why"
    return out


@pytest.fixture(scope="module")
def pages(out_dir):
    return {session: read_page(out_dir / f"session_{session}.html") for session in SESSIONS}


def test_one_deck_per_session_a_to_f(out_dir):
    sources = sorted(path.stem for path in SOURCES.glob("session_*.md"))
    assert sources == [f"session_{s}" for s in SESSIONS], f"book/slides/ should hold one source per session: {sources}"
    decks = sorted(path.stem for path in out_dir.glob("session_*.html"))
    assert decks == sources, f"decks built: {decks}"


@pytest.mark.parametrize("session", SESSIONS)
def test_each_deck_has_at_most_25_slides(pages, session):
    count = len(pages[session].slides)
    assert 5 <= count <= MAX_SLIDES, f"session_{session}: {count} slides (sub-slides included)"


@pytest.mark.parametrize("session", SESSIONS)
def test_no_deck_loads_anything_from_the_network(out_dir, session):
    addresses = every_address(out_dir / f"session_{session}.html")
    loaded = {url for _, _, url in addresses}
    # The parser must have seen what the deck really loads, or an empty result would prove nothing.
    assert {"revealjs/dist/reveal.js", "revealjs/dist/reveal.css", "mathjax/tex-chtml.js"} <= loaded, loaded
    assert any(url.endswith(".woff") for url in loaded), "the theme's font should be followed through its CSS"
    network = [f"{where.name}: {what} {url}" for where, what, url in addresses if remote(url)]
    assert not network, f"session_{session} loads from the network: {network}"


@pytest.mark.parametrize("session", SESSIONS)
def test_every_local_file_a_deck_refers_to_is_in_the_output(out_dir, session):
    checked, missing = 0, []
    for where, what, url in every_address(out_dir / f"session_{session}.html"):
        if not local_file(url):
            continue
        target = (where.parent / url.split("?")[0].split("#")[0]).resolve()
        checked += 1
        if not target.is_file() or not target.is_relative_to(out_dir.resolve()):
            missing.append(f"{where.name}: {what} {url}")
    assert checked >= 8, f"only {checked} local files found: the parser is missing references"
    assert not missing, f"session_{session} refers to files that are not in the output: {missing}"
    fonts = out_dir / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert any(fonts.glob("*.woff")), "MathJax loads its fonts from beside tex-chtml.js at runtime"


def test_the_vendored_reveal_is_the_version_nbconvert_expects(out_dir):
    expected = re.search(r"reveal\.js@([\d.]+)", SlidesExporter().reveal_url_prefix).group(1)
    vendored = REPO_ROOT / "book" / "_static" / "revealjs"
    assert f"reveal.js {expected}" in (vendored / "dist" / "reveal.js").read_text(encoding="utf-8")[:200]
    assert f"reveal.js {expected}" in (vendored / "README.txt").read_text(encoding="utf-8")
    assert (vendored / "LICENSE").is_file()
    assert (out_dir / "revealjs" / "dist" / "reveal.js").read_bytes() == (vendored / "dist" / "reveal.js").read_bytes()


@pytest.mark.parametrize("session,topic", [(s, t) for s in SESSIONS for t in TOPICS[s]])
def test_each_deck_covers_its_topics(pages, session, topic):
    text = pages[session].text
    missing = [phrase for phrase in TOPICS[session][topic] if normalise(phrase) not in text]
    assert not missing, f"session_{session}, topic {topic!r}: the deck never says {missing}"


@pytest.mark.parametrize("session", SESSIONS)
def test_each_deck_opens_with_its_session_and_notebooks_and_ends_with_a_demo_and_a_lab(pages, session):
    slides = pages[session].slides
    title, notebooks = slides[0], notebooks_of(session)
    assert title.startswith(f"Session {session.upper()}:"), title[:80]
    named = sorted(name for name in notebooks if name in title)
    assert len(named) >= min(3, len(notebooks)) > 0, f"the title slide of session_{session} names only {named}"
    demo = [slide for slide in slides if slide.startswith("Live demo")]
    assert len(demo) == 1 and any(name in demo[0] for name in notebooks), "one live-demo slide naming notebooks"
    assert slides[-1].startswith("What you can now do"), slides[-1][:80]
    assert "Homework" in slides[-1] or "Lab" in slides[-1]


@pytest.mark.parametrize("session", SESSIONS)
def test_notebooks_named_by_a_deck_exist(session):
    source = (SOURCES / f"session_{session}.md").read_text(encoding="utf-8")
    named, notebooks = set(re.findall(r"`(\d\db?_\w+)`", source)), notebooks_of(session)
    assert named and named <= notebooks, f"not in notebooks/session_{session}/: {sorted(named - notebooks)}"


@pytest.mark.parametrize("session", sorted(DECK_FIGURES))
def test_decks_show_the_books_own_figures(out_dir, pages, session):
    shown = {Path(url).name for what, url in pages[session].references if what == "<img src>"}
    assert DECK_FIGURES[session] <= shown, f"session_{session} shows {shown}"
    for name in DECK_FIGURES[session]:
        assert (out_dir / "figures" / name).read_bytes() == (FIGURES / name).read_bytes()


def python_blocks(source: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", source, re.S | re.M)


@pytest.mark.parametrize("session", SESSIONS)
def test_code_on_the_slides_names_the_courses_real_api(session):
    """Every `from course_lib... import name`, `python -m course_lib...` module, scripts/ and config/ file that a
    slide shows exists (a renamed function would otherwise leave the slides teaching a name that is gone)."""
    source = (SOURCES / f"session_{session}.md").read_text(encoding="utf-8")
    checked, wrong = 0, []
    for block in python_blocks(source):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    checked += 1
                    if not hasattr(module, alias.name):
                        wrong.append(f"{node.module}.{alias.name}")
    for module in set(re.findall(r"-m (course_lib[\w.]*)", source)):
        checked += 1
        if importlib.util.find_spec(module) is None:
            wrong.append(module)
    for path in set(re.findall(r"\b((?:scripts|config)/[\w./-]+\.\w+)", source)):
        checked += 1
        if not (REPO_ROOT / path).is_file():
            wrong.append(path)
    assert checked >= 2, f"session_{session} shows almost no code of the course"
    assert not wrong, f"session_{session} names what the repository does not have: {wrong}"


def write_deck(folder: Path, name: str, slides: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("\n\n---\n\n".join(slides) + "\n", encoding="utf-8")
    return path


def test_separators_sub_slides_and_notes(tmp_path):
    source = write_deck(tmp_path / "src", "session_z.md", [
        "# Session Z: a deck\n\nNote: said, not shown",
        "## Code\n\n```bash\necho one\n---\necho two\n```\n\n--\n\n## Below\n\n$x^2$",
    ])
    assert build_slides.main(["--source", str(source.parent), "--out", str(tmp_path / "out")]) == 0
    page = read_page(tmp_path / "out" / "session_z.html")
    assert len(page.slides) == 3 and page.notes == 1, (page.slides, page.notes)
    assert "said, not shown" not in page.text and "echo two" in page.slides[1] and "$x^2$" in page.slides[2]


def test_a_deck_of_25_slides_builds_and_one_of_26_fails_naming_the_file(tmp_path, capsys):
    slides = ["# Session Z: long"] + [f"## Slide {n}" for n in range(2, 26)]
    ok = write_deck(tmp_path / "ok", "session_z.md", slides)
    assert build_slides.main(["--source", str(ok.parent), "--out", str(tmp_path / "out_ok")]) == 0
    assert len(read_page(tmp_path / "out_ok" / "session_z.html").slides) == 25
    long = write_deck(tmp_path / "long", "session_z.md", [*slides, "## Slide 26"])
    assert build_slides.main(["--source", str(long.parent), "--out", str(tmp_path / "out_long")]) == 1
    error = capsys.readouterr().err
    assert str(long) in error and "26 slides" in error, error
    assert not (tmp_path / "out_long" / "session_z.html").exists()


@pytest.mark.parametrize("image,reason", [
    ("![a plot](https://example.org/plot.png)", "https://example.org/plot.png"),
    ('<img src="//cdn.example.org/plot.png">', "//cdn.example.org/plot.png"),
    ("![a plot](../_static/figures/no_such_figure.png)", "no_such_figure.png does not exist"),
])
def test_a_deck_with_a_network_or_missing_image_fails_naming_the_file(tmp_path, capsys, image, reason):
    bad = write_deck(tmp_path / "src", "session_z.md", ["# Session Z", f"## A figure\n\n{image}"])
    good = write_deck(tmp_path / "src", "session_y.md", ["# Session Y", "## Fine"])
    assert build_slides.main(["--source", str(bad.parent), "--out", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert str(bad) in error and reason in error and str(good) not in error, error
    assert not list((tmp_path / "out").glob("*.html")), "a failed build must write no deck"


def test_the_builds_own_check_catches_what_a_page_loads_from_the_network(tmp_path):
    """The final check on the produced HTML (not only on the sources): a stylesheet, a script and a CSS @import
    from the network, and a local file that is not there, are each reported."""
    (tmp_path / "style.css").write_text('@import "https://fonts.example.org/font.css";\n', encoding="utf-8")
    page = tmp_path / "deck.html"
    page.write_text('<link rel="stylesheet" href="style.css"><script src="https://cdn.example.org/x.js"></script>'
                    '<img src="figures/missing.png"><a href="#slide-2">next</a>', encoding="utf-8")
    problems = "\n".join(build_slides.page_problems(page, tmp_path))
    assert "https://fonts.example.org/font.css" in problems
    assert "https://cdn.example.org/x.js" in problems
    assert "figures/missing.png" in problems
    assert "#slide-2" not in problems and "style.css refers" not in problems

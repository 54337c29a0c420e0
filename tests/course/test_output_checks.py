"""scripts/output_checks.py: the checks that keep the machine's folders and unchosen stderr out of notebook outputs
(tests/course/test_notebooks.py) and out of the built book (scripts/build_book.py), and that every lesson page of
an executed book shows its outputs."""

import tempfile
from pathlib import Path

import build_book  # scripts/ is on sys.path
import nbformat
import pytest
import torch
import yaml
from output_checks import (  # scripts/ is on sys.path
    html_problems,
    machine_folders,
    notebook_page_problems,
    output_problems,
    page_cells,
    temporary_paths,
)

from course_lib.nbtools import expect_error, shown

REPO_ROOT = Path(__file__).resolve().parents[2]


def notebook(*cells):
    nb = nbformat.v4.new_notebook()
    for outputs, tags in cells:
        cell = nbformat.v4.new_code_cell("pass", outputs=outputs)
        cell.metadata["tags"] = tags
        nb.cells.append(cell)
    return nb


def stream(name, text):
    return nbformat.v4.new_output("stream", name=name, text=text)


def test_stderr_and_machine_folders_in_outputs_are_named_by_cell():
    folders = machine_folders("/tmp/run-123")
    nb = notebook(([stream("stdout", "checkpoint: runs/a/ckpt.pt\n")], []),
                  ([stream("stderr", "UserWarning: something\n")], []),
                  ([stream("stdout", f"saved to {REPO_ROOT}/runs/a\n")], []),
                  ([nbformat.v4.new_output("execute_result", data={"text/plain": "'/tmp/run-123/x'"})], []),
                  ([stream("stderr", "shown on purpose\n")], ["show-stderr"]))
    problems = output_problems(nb, folders)
    assert [p.split(":")[0] for p in problems] == ["cell 1", "cell 2", "cell 3"], problems
    assert "UserWarning" in problems[0] and str(REPO_ROOT) in problems[1] and "/tmp/run-123" in problems[2]


def test_built_pages_with_stderr_boxes_or_machine_folders_are_named(tmp_path):
    (tmp_path / "clean.html").write_text('<div class="output stream highlight-myst-ansi">runs/a</div>')
    (tmp_path / "warned.html").write_text('<div class="output stderr highlight-myst-ansi">UserWarning</div>')
    (tmp_path / "leaky.html").write_text(f"<pre>runs go to {REPO_ROOT}/runs/x</pre>")
    problems = html_problems(tmp_path, machine_folders())
    assert problems[0].startswith("leaky.html: shows the machine's folder")
    assert problems[1] == "warned.html: 1 stderr output box(es)"
    assert len(problems) == 2


def test_shown_paths_and_expect_error_tracebacks_name_no_machine_folder(capsys):

    assert shown(REPO_ROOT / "runs" / "x") == "runs/x"
    assert shown(REPO_ROOT) == "."
    assert shown(torch.__file__) == "site-packages/torch/__init__.py"
    with expect_error(ValueError):
        shown_error()
    out = capsys.readouterr().out
    assert "tests/course/test_output_checks.py" in out and str(REPO_ROOT) not in out


def shown_error():
    raise ValueError("on purpose")


SPAWNED = f"{tempfile.gettempdir()}/course-notebook-functions-4242-k2j3h4g5/_notebook_break_rank_2_0123456789ab.py"


def test_temporary_paths_and_spawned_modules_in_outputs_are_named_but_a_runs_own_folder_is_allowed():
    traceback = f'Traceback (most recent call last):\n  File "{SPAWNED}", line 9, in break_rank_2\n'
    elsewhere = "/var/folders/x/T/course-notebook-functions-7-abc/_notebook_f_1.py"  # another machine's temp folder
    own = f"{tempfile.gettempdir()}/pytest-of-someone/test_x0/out_dir"
    nb = notebook(([stream("stdout", traceback)], []),
                  ([stream("stdout", f"File {elsewhere}\n")], []),
                  ([stream("stdout", f"saved {own}/ckpt.pt\n")], []),
                  ([stream("stdout", 'File "<notebook function break_rank_2>", line 9, in break_rank_2\n')], []),
                  ([stream("stdout", "write checkpoints to /tmp, not to the shared file system\n")], []))
    problems = output_problems(nb, machine_folders(), allowed=[own])
    assert [p.split(":")[0] for p in problems] == ["cell 0", "cell 1"], problems
    assert SPAWNED in problems[0] and elsewhere in problems[1]
    assert temporary_paths(f"saved {own}/ckpt.pt") == [f"{own}/ckpt.pt"], "allowed only where the caller says so"


def cell_html(*outputs):
    """A code cell as myst-nb writes it: its input, then one output area per output (none: no area)."""
    areas = "".join(f'<div class="cell_output docutils container"><div class="output stream highlight-myst-ansi '
                    f'notranslate"><div class="highlight"><pre><span></span>{text}</pre></div></div></div>'
                    for text in outputs)
    return (f'<div class="cell docutils container"><div class="cell_input docutils container"><div class="highlight-'
            f'ipython3 notranslate"><div class="highlight"><pre>print(1)</pre></div></div></div>{areas}</div>')


def book(tmp_path, pages):
    """A built book: {name: (html cells, graded?)} -> html/notebooks/s/<name>.html and source notebooks/s/<name>.ipynb."""
    html_dir, source_dir = tmp_path / "html", tmp_path / "source"
    for name, (cells, graded) in pages.items():
        page = html_dir / "notebooks" / "s" / f"{name}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"<html><body><h1>{name}</h1>{''.join(cells)}</body></html>")
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("seed = 0"), nbformat.v4.new_code_cell("print(1)")]
        if graded:
            nb.cells[1].metadata["nbgrader"] = {"grade": True, "grade_id": "ex1_tests", "points": 1, "locked": True,
                                                "solution": False, "schema_version": 3}
        source = source_dir / "notebooks" / "s" / f"{name}.ipynb"
        source.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, source)
    (html_dir / "book").mkdir(parents=True)
    (html_dir / "book" / "chapter.html").write_text("<p>a chapter: no notebook, no cells</p>")
    return html_dir, source_dir


def test_lesson_pages_without_outputs_fail_graded_pages_are_exempt(tmp_path):
    html_dir, source_dir = book(tmp_path, {
        "lesson_run": ([cell_html(), cell_html("loss 2.31")], False),    # the parameters cell shows nothing: fine
        "lesson_not_run": ([cell_html(), cell_html()], False),
        "exercises": ([cell_html(), cell_html()], True),
    })
    problems = notebook_page_problems(html_dir, source_dir, machine_folders())
    assert len(problems) == 1 and problems[0].startswith("notebooks/s/lesson_not_run.html: a lesson notebook whose "
                                                         "2 code cells show no output"), problems
    assert notebook_page_problems(html_dir, source_dir, machine_folders(), executed=False) == [], (
        "a build that does not execute notebooks shows no outputs anywhere: only executed builds are checked")


def test_outputs_of_built_pages_showing_machine_or_temporary_folders_are_named(tmp_path):
    html_dir, source_dir = book(tmp_path, {
        "lab": ([cell_html("ok"), cell_html(f"File &quot;{SPAWNED}&quot;, line 9"), cell_html(f"{REPO_ROOT}/runs")],
                False),
    })
    (html_dir / "book" / "chapter.html").write_text("<p>write to /tmp/tp.ipynb</p>")  # prose may name /tmp
    problems = notebook_page_problems(html_dir, source_dir, machine_folders(), executed=False)
    assert [p.split(" shows")[0] for p in problems] == ["notebooks/s/lab.html: code cell 1",
                                                         "notebooks/s/lab.html: code cell 2"], problems
    assert SPAWNED in problems[0] and str(REPO_ROOT) in problems[1]


MINI_CONFIG = """title: mini
only_build_toc_files: true
exclude_patterns: [_static]
execute:
  execute_notebooks: cache
  exclude_patterns:
    - notebooks/s/exercises.ipynb
launch_buttons:
  thebe: false
sphinx:
  config:
    extensions: [myst_nb, jupyter_book, sphinx_comments, sphinx_external_toc, sphinx_book_theme]
    html_static_path: ["_static"]
    mathjax_path: mathjax/tex-chtml.js
"""
MINI_TOC = "format: jb-book\nroot: intro\nchapters:\n  - file: notebooks/s/lesson\n  - file: notebooks/s/exercises\n"


def mini_book(root: Path, exercises: str) -> Path:
    """A two-notebook book: `lesson` executed, `exercises` excluded from execution; `exercises` is "lesson" (no
    grade cells) or "graded" (a printing cell, an answer that raises until written, and its failing test)."""
    (root / "_static" / "mathjax").mkdir(parents=True)
    (root / "_static" / "mathjax" / "tex-chtml.js").write_text("// stands in for the vendored MathJax\n")
    (root / "notebooks" / "s").mkdir(parents=True)
    (root / "_config.yml").write_text(MINI_CONFIG)
    (root / "_toc.yml").write_text(MINI_TOC)
    (root / "intro.md").write_text("# A small book\n")
    for name in ("lesson", "exercises"):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), nbformat.v4.new_code_cell("print(6 * 7)")]
        if exercises == "graded" and name == "exercises":
            grading = {"locked": False, "points": 0, "schema_version": 3, "grade": False, "solution": True}
            nb.cells += [
                nbformat.v4.new_code_cell('raise NotImplementedError("write answer")',
                                          metadata={"nbgrader": {**grading, "grade_id": "ex1"}}),
                nbformat.v4.new_code_cell("assert answer == 42", metadata={"nbgrader": {
                    **grading, "grade_id": "ex1_tests", "grade": True, "solution": False, "points": 1, "locked": True}}),
            ]
        nbformat.write(nb, root / "notebooks" / "s" / f"{name}.ipynb")
    return root


@pytest.mark.slow
def test_an_executed_build_fails_when_a_lesson_shows_no_outputs(tmp_path, capsys):
    source = mini_book(tmp_path / "book", exercises="lesson")
    status = build_book.build(source, tmp_path / "out", execute=True)
    err = capsys.readouterr().err
    assert status == 1 and "notebooks/s/exercises.html: a lesson notebook whose 1 code cells show no output" in err
    assert "notebooks/s/lesson.html" not in err, "the executed lesson shows its output"


@pytest.mark.slow
def test_an_executed_build_runs_a_graded_notebook_around_its_answers(tmp_path, capsys, monkeypatch):
    source = mini_book(tmp_path / "book", exercises="graded")
    committed = (source / "notebooks" / "s" / "exercises.ipynb").read_bytes()
    monkeypatch.setattr(build_book, "EXECUTED_AROUND_ANSWERS", ("notebooks/s/exercises.ipynb",))
    status = build_book.build(source, tmp_path / "out", execute=True)
    assert status == 0, capsys.readouterr().err
    page = tmp_path / "out" / "_build" / "html" / "notebooks" / "s" / "exercises.html"
    cells = page_cells(page.read_text(encoding="utf-8"))
    assert [cell.outputs for cell in cells] == [1, 0, 0], "the printing cell ran; the answer and its test did not"
    assert "42" in cells[0].output_text[0]
    assert (source / "notebooks" / "s" / "exercises.ipynb").read_bytes() == committed, (
        "the notebook in the sources is unchanged: only the staged copy is tagged skip-execution")


def test_a_graded_notebook_run_around_its_answers_shows_every_other_cell(tmp_path):
    html_dir, source_dir = book(tmp_path, {"lab": ([cell_html(), cell_html()], True)})
    around = ("notebooks/s/lab.ipynb",)
    problems = notebook_page_problems(html_dir, source_dir, machine_folders(), executed_around_answers=around)
    assert len(problems) == 1 and problems[0].startswith("notebooks/s/lab.html: code cell 0 shows no output"), problems
    (html_dir / "notebooks" / "s" / "lab.html").write_text(cell_html("0") + cell_html())  # the test cell: not run
    assert notebook_page_problems(html_dir, source_dir, machine_folders(), executed_around_answers=around) == []
    (html_dir / "notebooks" / "s" / "lab.html").write_text(cell_html("0"))
    problems = notebook_page_problems(html_dir, source_dir, machine_folders(), executed_around_answers=around)
    assert problems == ["notebooks/s/lab.html: the page shows 1 code cells, the notebook has 2"], problems
    assert notebook_page_problems(html_dir, source_dir, machine_folders(), executed=False,
                                  executed_around_answers=around) == []


def test_staged_sources_tag_the_answers_of_the_labs_and_leave_the_repository_alone(tmp_path):
    root = Path(build_book.__file__).resolve().parents[1]
    before = {name: (root / name).read_bytes() for name in build_book.EXECUTED_AROUND_ANSWERS}
    staged = build_book.stage_sources(root, tmp_path / "staged")
    assert not (staged / ".git").exists() and not (staged / ".venv").exists()
    assert (staged / "_toc.yml").read_bytes() == (root / "_toc.yml").read_bytes()
    excluded = yaml.safe_load((staged / "_config.yml").read_text())["execute"]["exclude_patterns"]
    committed = yaml.safe_load((root / "_config.yml").read_text())["execute"]["exclude_patterns"]
    assert set(build_book.EXECUTED_AROUND_ANSWERS) <= set(committed), "the labs are excluded in the committed config"
    assert sorted(excluded) == sorted(set(committed) - set(build_book.EXECUTED_AROUND_ANSWERS))
    for name in build_book.EXECUTED_AROUND_ANSWERS:
        assert (root / name).read_bytes() == before[name]
        cells = [cell for cell in nbformat.read(staged / name, as_version=4).cells if cell.cell_type == "code"]
        tagged = [build_book.SKIP_TAG in cell.metadata.get("tags", []) for cell in cells]
        assert tagged == [build_book.is_answer_or_test(cell) for cell in cells], name
        assert sum(tagged) >= 10 and not all(tagged), name
        assert not any(build_book.SKIP_TAG in cell.metadata.get("tags", [])
                       for cell in nbformat.read(root / name, as_version=4).cells), f"{name} is committed untagged"

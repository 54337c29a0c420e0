"""scripts/output_checks.py: the checks that keep the machine's folders and unchosen stderr out of notebook outputs
(tests/course/test_notebooks.py) and out of the built book (scripts/build_book.py)."""

from pathlib import Path

import nbformat
import torch
from output_checks import html_problems, machine_folders, output_problems  # scripts/ is on sys.path

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

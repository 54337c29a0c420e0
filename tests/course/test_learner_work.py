"""A learner's work survives the course's own commands: `make release` refuses to overwrite or delete a student
notebook that changed after it wrote it, and `make lab` works in workspace/, which only ever gains notebooks."""

import json
import os
import time
from pathlib import Path

import grading  # scripts/ is on sys.path (tests/conftest.py)
import pytest
import workspace

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_release(monkeypatch, tmp_path):
    """release() with nbgrader replaced by a tree of files chosen by the test (release's own logic runs)."""
    tree = {}

    def build(root, dest):
        for rel, text in tree.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text)
        return sorted(Path(rel) for rel in tree)

    monkeypatch.setattr(grading, "build_release", build)
    monkeypatch.setattr(grading, "_orphan_notebooks", lambda root, out_dir: sorted(
        p for p in out_dir.glob("*/*.ipynb") if p.relative_to(out_dir).as_posix() not in tree))
    return tree


def test_release_refuses_to_overwrite_a_notebook_edited_after_it_wrote_it(tmp_path, fake_release, capsys):
    out = tmp_path / "notebooks"
    fake_release.update({"session_a/01.ipynb": "v1", "session_a/02.ipynb": "v1"})
    grading.release(tmp_path, out)
    recorded = json.loads((out / grading.RELEASED).read_text())
    assert set(recorded) == {"session_a/01.ipynb", "session_a/02.ipynb"}

    (out / "session_a" / "01.ipynb").write_text("v1 with my answers")
    fake_release.update({"session_a/01.ipynb": "v2", "session_a/02.ipynb": "v2"})
    with pytest.raises(grading.ReleaseRefused, match=r"(?s)01\.ipynb.*Nothing was written.*workspace.*--force"):
        grading.release(tmp_path, out)
    assert (out / "session_a" / "01.ipynb").read_text() == "v1 with my answers"
    assert (out / "session_a" / "02.ipynb").read_text() == "v1", "a refused release must write nothing"

    assert grading.main(["--root", str(tmp_path), "release", "--out-dir", str(out)]) == 1
    assert "--force" in capsys.readouterr().err

    grading.release(tmp_path, out, force=True)
    assert (out / "session_a" / "01.ipynb").read_text() == "v2" and (out / "session_a" / "02.ipynb").read_text() == "v2"


def test_release_updates_its_own_notebooks_and_refuses_to_delete_an_edited_orphan(tmp_path, fake_release):
    out = tmp_path / "notebooks"
    fake_release.update({"session_a/01.ipynb": "v1", "session_a/gone.ipynb": "v1"})
    grading.release(tmp_path, out)
    fake_release["session_a/01.ipynb"] = "v2"
    del fake_release["session_a/gone.ipynb"]
    (out / "session_a" / "gone.ipynb").write_text("v1 and my notes")
    with pytest.raises(grading.ReleaseRefused, match="gone.ipynb"):
        grading.release(tmp_path, out)
    (out / "session_a" / "gone.ipynb").write_text("v1")  # as release wrote it: may go
    changed = grading.release(tmp_path, out)
    assert sorted(p.name for p in changed) == ["01.ipynb", "gone.ipynb"]
    assert not (out / "session_a" / "gone.ipynb").exists() and (out / "session_a" / "01.ipynb").read_text() == "v2"


def test_the_committed_release_record_matches_the_notebooks():
    recorded = json.loads((REPO_ROOT / "notebooks" / grading.RELEASED).read_text())
    on_disk = {p.relative_to(REPO_ROOT / "notebooks").as_posix() for p in (REPO_ROOT / "notebooks").rglob("*.ipynb")}
    assert set(recorded) == on_disk
    assert grading.edited_since_release(REPO_ROOT / "notebooks", sorted((REPO_ROOT / "notebooks").rglob("*.ipynb"))) == []


def test_the_workspace_only_ever_gains_notebooks(tmp_path):
    root = tmp_path / "course"
    (root / "notebooks" / "session_a").mkdir(parents=True)
    (root / "notebooks" / "session_a" / "01.ipynb").write_text("released v1")
    first = workspace.sync_workspace(root)
    mine = root / "workspace" / "session_a" / "01.ipynb"
    assert first["added"] == [mine] and mine.read_text() == "released v1"
    mine.write_text("my answers")
    (root / "notebooks" / "session_a" / "02.ipynb").write_text("released v1")
    time.sleep(0.01)
    (root / "notebooks" / "session_a" / "01.ipynb").write_text("released v2")
    os.utime(root / "notebooks" / "session_a" / "01.ipynb", (time.time() + 5, time.time() + 5))
    second = workspace.sync_workspace(root)
    assert mine.read_text() == "my answers", "the workspace copy was overwritten"
    assert second["added"] == [root / "workspace" / "session_a" / "02.ipynb"]
    assert second["newer"] == [root / "notebooks" / "session_a" / "01.ipynb"]


def test_make_lab_opens_the_workspace_and_git_ignores_it():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "$(PY) scripts/workspace.py" in makefile and "--notebook-dir=workspace" in makefile
    assert "/workspace/" in (REPO_ROOT / ".gitignore").read_text().splitlines()

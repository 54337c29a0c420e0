from course_lib.core.model import GPTConfig
import pytest

from course_lib.nbtools import expect_error, predict, repo_root, reveal


def test_expect_error_prints_the_message(capsys):
    with expect_error(ValueError):
        GPTConfig(n_embd=100, n_head=3)
    out = capsys.readouterr().out
    assert out.startswith("Traceback") and "ValueError: GPTConfig.n_embd (100)" in out


def test_expect_error_lets_other_errors_through_and_reports_no_error(capsys):
    try:
        with expect_error(KeyError):
            raise ValueError("not the expected kind")
    except ValueError:
        pass
    else:
        raise AssertionError("a ValueError should pass through expect_error(KeyError)")
    with expect_error():
        pass
    assert "no error was raised" in capsys.readouterr().out


def test_repo_root_from_anywhere(tmp_path):
    root = repo_root(tmp_path)  # not inside the repo: falls back to course_lib's parent
    assert (root / "config" / "config.json").is_file()
    assert repo_root(root / "solutions") == root


def test_a_prediction_is_printed_then_revealed_against_the_measurement(capsys):
    predict("deeper: loss lower or higher?", None, choices=("lower", "higher"))
    assert "no prediction written" in capsys.readouterr().out
    predict("deeper: loss lower or higher?", "lower", choices=("lower", "higher"))
    assert "your prediction: 'lower'" in capsys.readouterr().out
    reveal("deeper: loss lower or higher?", "lower", "higher")
    out = capsys.readouterr().out
    assert "measured: 'higher'" in out and "not this time" in out
    reveal("deeper: loss lower or higher?", "higher", "higher")
    assert "you predicted 'higher': right" in capsys.readouterr().out
    with pytest.raises(ValueError, match="predict one of 'lower', 'higher', got 'maybe'"):
        predict("deeper: loss lower or higher?", "maybe", choices=("lower", "higher"))


def test_paths_are_shown_relative_to_the_repository_the_notebook_runs_in(tmp_path, monkeypatch):
    from pathlib import Path

    from course_lib.nbtools import relative_paths, repo_root, shown

    own = repo_root(Path(__file__).parent)
    assert shown(own / "runs" / "x") == "runs/x" and shown(own) == "."
    copy = tmp_path / "copy"  # another copy of the repository, as the book's build stages one
    (copy / "config").mkdir(parents=True)
    (copy / "config" / "config.json").write_text("{}")
    (copy / "notebooks").mkdir()
    monkeypatch.chdir(copy / "notebooks")
    assert shown(copy / "runs" / "job" / "run_1") == "runs/job/run_1" and shown(copy) == "."
    assert relative_paths(f"see {copy}/runs/job/run_1/train.log") == "see runs/job/run_1/train.log"
    monkeypatch.chdir(tmp_path)  # not in a repository: its folders are shown as they are
    assert shown(copy / "runs") == str(copy / "runs")

from course_lib.core.model import GPTConfig
from course_lib.nbtools import expect_error, repo_root


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

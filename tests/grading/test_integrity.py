"""What judges a graded check cannot be replaced under it (course_tools/grading/integrity.py): the snapshot on its
own, in the grading sandbox (after the answer, after the tests) and in the ranks a check launches.

    .venv/bin/python -m pytest -q tests/grading/test_integrity.py
"""

from __future__ import annotations

import math
import types

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from course_lib.runtime.launch import RANK_CONTEXT_VARIABLE, RankFailure, launch
from course_tools.grading import grade
from course_tools.grading.integrity import RANK_CONTEXT, IntegrityError, Snapshot

# ------------------------------------------------------------------ the snapshot


def test_a_replaced_function_is_named_however_it_was_replaced(monkeypatch):
    original = torch.testing.assert_close
    for replace in (lambda f: setattr(torch.testing, "assert_close", f),
                    lambda f: vars(torch.testing).__setitem__("assert_close", f)):
        snapshot = Snapshot.take()
        replace(lambda *a, **k: None)
        try:
            assert snapshot.changed() == ["torch.testing.assert_close"]
            with pytest.raises(IntegrityError, match=r"after the answer ran, `torch.testing.assert_close` is no longer"):
                snapshot.verify("after the answer ran")
        finally:
            torch.testing.assert_close = original
        snapshot.verify("once it is put back")  # the same object again: nothing to report


def test_methods_of_tensors_and_modules_are_watched():
    snapshot = Snapshot.take()
    assert "allclose" not in vars(torch.Tensor), "defined on a base class: a patch on Tensor shadows it"
    torch.Tensor.allclose = lambda self, other, **kwargs: True
    try:
        assert snapshot.changed() == ["torch.Tensor.allclose", "torch.nn.Parameter.allclose"]
    finally:
        del torch.Tensor.allclose
    assert snapshot.changed() == []


def test_state_and_new_attributes_are_not_changes(monkeypatch):
    module = types.ModuleType("course_lib._integrity_probe")
    module.counter, module.table, module.helper = 0, {}, lambda: 1
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    snapshot = Snapshot.take()
    module.counter += 1          # a library's state changes while it runs
    module.table["key"] = "value"
    module.lazily_added = len    # a lazy import adds a submodule to its package
    assert snapshot.changed() == []
    module.helper = lambda: 2
    assert snapshot.changed() == ["course_lib._integrity_probe.helper"]


def test_the_setup_names_are_watched_after_the_answer_not_after_the_tests():
    namespace = {"reference": math.sqrt, "LIMIT": 10, "expected": torch.ones(2)}
    snapshot = Snapshot.take(namespace, list(namespace))
    namespace["reference"] = math.cbrt
    namespace["expected"] = torch.zeros(2)
    assert snapshot.changed() == ["reference", "expected"]
    assert snapshot.changed(names=False) == [], "a test cell may bind its own names"


# ------------------------------------------------------------------ in the grading sandbox

SCALE_REFERENCE = '''def scale(x):
    ### BEGIN SOLUTION
    class Holder:
        pass

    holder = Holder()
    setattr(holder, "factor", 2.0)  # the reference uses setattr (on its own object): answers may too
    return x * holder.factor
    ### END SOLUTION'''

SCALE_TESTS = '''result = scale(torch.ones(3))
torch.testing.assert_close(result, torch.full((3,), 2.0))
print("visible tests passed")'''

WRONG = "def scale(x):\n    return x  # wrong: the tests must fail it\n"
CHEATS = {
    "setattr on the module": 'setattr(getattr(torch, "testing"), "assert_close", lambda *a, **k: None)\n' + WRONG,
    "an alias the audit cannot follow": (
        "def testing_module():\n    return torch.testing\n\n\n"
        "testing_module().assert_close = lambda *a, **k: None\n" + WRONG),
    "code loaded at run time": '''import os
import tempfile

folder = tempfile.mkdtemp()
with open(os.path.join(folder, "hubconf.py"), "w") as file:
    file.write("import torch\\ntorch.testing.assert_close = lambda *a, **k: None\\n\\n\\ndef entry():\\n    return 0\\n")
torch.hub.load(folder, "entry", source="local", trust_repo=True)
''' + WRONG,
    "a patch made while the tests run": '''def scale(x):
    setattr(getattr(torch, "testing"), "assert_close", lambda *a, **k: None)
    return x
''',
}


@pytest.fixture(scope="module")
def scale_notebook(tmp_path_factory):
    def code(source, grade_id, **nbgrader):
        cell = new_code_cell(source)
        cell.metadata["nbgrader"] = {"grade_id": grade_id, "schema_version": 3, "solution": False, "grade": False,
                                     "locked": False, **nbgrader}
        return cell

    nb = new_notebook(cells=[
        code("import math\nimport torch", "setup", locked=True),
        code(SCALE_REFERENCE, "scale", solution=True),
        code(SCALE_TESTS, "scale_tests", grade=True, locked=True, points=1),
    ])
    path = tmp_path_factory.mktemp("course") / "scale.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_patched_check_fails_with_the_attribute_named(scale_notebook):
    submissions = {name: {"scale": answer} for name, answer in CHEATS.items()}
    submissions["wrong"] = {"scale": WRONG}
    submissions["right, with setattr"] = {"scale": "def scale(x):\n    doubled = x + x\n    return doubled"}
    results = {name: result["scale_tests"] for name, result in grade(scale_notebook, submissions).items()}
    assert results["right, with setattr"].passed, results["right, with setattr"].error
    assert not results["wrong"].passed and "AssertionError" in results["wrong"].error
    for name in CHEATS:
        result = results[name]
        assert not result.passed, f"{name}: the patched check passed"
        assert "IntegrityError: `torch.testing.assert_close` is what the checks judge with" in result.error, (
            name, result.error)
        culprit = "hubconf.py" if name == "code loaded at run time" else "_answer_scale.py"
        assert f"{culprit} may not replace it" in result.error, (name, result.error)


SELF_RESTORING = '''def scale(x):
    testing = getattr(torch, "testing")
    real = testing.assert_close

    def once(*args, **kwargs):
        setattr(testing, "assert_close", real)  # the original back: nothing left for a snapshot to see

    setattr(testing, "assert_close", once)
    return x
'''


def test_a_patch_that_undoes_itself_is_refused_as_it_happens(scale_notebook):
    result = grade(scale_notebook, {"sly": {"scale": SELF_RESTORING}})["sly"]["scale_tests"]
    assert not result.passed and "IntegrityError: `torch.testing.assert_close` is what the checks judge with" in (
        result.error), result.error


def test_the_snapshot_still_sees_what_the_guard_cannot(monkeypatch):
    """A write to a module's dictionary goes around the guard (the audit refuses `vars` and `__dict__` in an answer;
    code loaded at run time could do it): the snapshot names it when the check ends."""
    from course_tools.grading import integrity

    snapshot = Snapshot.take()
    original = math.isclose
    monkeypatch.setitem(vars(math), "isclose", lambda *a, **k: True)
    assert snapshot.changed() == ["math.isclose"]
    monkeypatch.undo()
    assert math.isclose is original and snapshot.changed() == []
    assert integrity.untrusted_caller() is not None, "this test file is not trusted code"


def test_an_import_alias_is_refused_before_it_runs(scale_notebook):
    cheat = "import torch as _torch\n_torch.testing.assert_close = lambda *a, **k: None\n" + WRONG
    result = grade(scale_notebook, {"alias": {"scale": cheat}})["alias"]["scale_tests"]
    assert not result.passed and result.error.startswith("AnswerRefused")
    assert "`_torch.testing.assert_close` changes `_torch`" in result.error, result.error


# ------------------------------------------------------------------ in the ranks of a graded check

def patch_isclose_on_rank_1():
    import math

    import torch.distributed as dist

    if dist.get_rank() == 1:
        math.isclose = lambda *args, **kwargs: True
    return dist.get_rank()


def test_a_rank_of_a_graded_check_fails_when_its_worker_replaced_a_function(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "fork")
    assert launch(patch_isclose_on_rank_1, 2, log_dir=tmp_path / "plain", timeout_s=10, echo=False) == [0, 1], (
        "outside grading, a rank's worker may do what it likes")
    monkeypatch.setenv(RANK_CONTEXT_VARIABLE, RANK_CONTEXT)
    with pytest.raises(RankFailure) as failure:
        launch(patch_isclose_on_rank_1, 2, log_dir=tmp_path / "graded", timeout_s=10, echo=False)
    assert "rank 1" in str(failure.value) and "IntegrityError" in str(failure.value)
    assert "`math.isclose`" in str(failure.value)

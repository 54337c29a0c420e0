"""The audit of an answer cell: every class of cheat is refused with its line, and plain answers pass.

    .venv/bin/python -m pytest -q tests/grading/test_audit.py
"""

from __future__ import annotations

import pytest

from course_tools.grading.audit import audit

REFERENCE_FUNCTION = '''
def causal_attention(q, k, v):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return F.softmax(scores, dim=-1) @ v
'''
REFERENCE_METHOD = '''
class MyGPT(GPT):
    def forward(self, idx, targets=None):
        x = self.tok_emb(idx)
        return self.lm_head(x), None
'''
CONTEXT = {"torch": "module:torch", "math": "module:math", "F": "module:torch.nn.functional", "nn": "module:torch.nn",
           "GPT": "course_lib.core.model", "library": "module:course_lib.core.model", "mock": "module:unittest.mock",
           "seed": "builtins", "os": "module:os", "DistributedSampler": "torch.utils.data.distributed"}


def messages(answer: str, reference: str = REFERENCE_FUNCTION) -> str:
    return "\n".join(str(v) for v in audit(answer, reference, CONTEXT))


@pytest.mark.parametrize("answer", [
    REFERENCE_FUNCTION,
    # written differently: other helper names, a loop, an import of the standard library, a private helper
    '''
import math as m

def _scale(x):
    return x / m.sqrt(x.shape[-1])

def causal_attention(q, k, v):
    weights = torch.softmax(_scale(q @ k.mT), dim=-1)
    out = weights @ v
    return out
''',
])
def test_plain_answers_pass(answer):
    assert messages(answer) == ""


def test_methods_written_differently_pass():
    answer = '''
class MyGPT(GPT):
    """docstring"""
    def forward(self, idx, targets=None):
        h = self.tok_emb(idx)
        logits = self.lm_head(h)
        self.last_shape = tuple(logits.shape)
        return logits, None
'''
    assert messages(answer, REFERENCE_METHOD) == ""


@pytest.mark.parametrize(("answer", "expected"), [
    ("causal_attention = library.causal_attention", "must be defined in this cell with `def causal_attention`"),
    ("def causal_attention(q, k, v):\n    return library.causal_attention(q, k, v)", "`library` comes from course_lib"),
    ("from course_lib.core.model import causal_attention", "import only"),
    ("def causal_attention(q, k, v):\n    import course_lib.core.model as m\n    return m.causal_attention(q, k, v)",
     "another implementation of `causal_attention`"),
])
def test_delegation_is_refused(answer, expected):
    assert expected in messages(answer)


def test_super_of_the_written_method_is_refused():
    answer = "class MyGPT(GPT):\n    def forward(self, idx, targets=None):\n        return super().forward(idx, targets)"
    assert "`super().forward` runs the given implementation" in messages(answer, REFERENCE_METHOD)
    answer = "class MyGPT(GPT):\n    def forward(self, idx, targets=None):\n        return GPT.forward(self, idx, targets)"
    assert "another implementation of `forward`" in messages(answer, REFERENCE_METHOD)


@pytest.mark.parametrize(("line", "expected"), [
    ("torch.testing.assert_close = lambda *a, **k: None", "changes `torch`"),
    ("math.isclose = lambda *a, **k: True", "changes `math`"),
    ("library.causal_attention = causal_attention", "changes `library`"),
    ("isinstance = lambda *a: True", "`isinstance` is a name of the setup cells or a Python builtin"),
    ("seed = 1", "`seed` is a name of the setup cells"),
    ("t = torch.testing\nt.assert_close = print", "changes `t`"),
    ("def f():\n    global library\n    library = None", "`global library`"),
    ("os.environ['X'] = '1'", "changes `os`"),
    ("mock.patch('torch.testing.assert_close', print).start()", "`mock` comes from unittest.mock"),
])
def test_changing_the_checks_is_refused(line, expected):
    assert expected in messages(REFERENCE_FUNCTION + "\n" + line)


@pytest.mark.parametrize(("line", "expected"), [
    ("get_ipython().ast_transformers.append(object())", "`get_ipython` runs or changes code"),
    ("import sys", "`import sys`"),
    ("from IPython import get_ipython", "import only"),
    ("import builtins", "`import builtins`"),
    ("import unittest.mock", "`import unittest.mock`"),
    ("exec('x = 1')", "`exec` runs or changes code"),
    ("setattr(torch, 'testing', None)", "`setattr(torch, 'testing', None)` changes `torch`"),
    ("setattr(torch.testing, 'assert_close', print)", "changes `torch.testing`"),
    ("import math as m\nsetattr(m, 'isclose', print)", "changes `m`"),
    ("f = setattr\nf(torch, 'testing', None)", "`setattr` runs or changes code"),
    ("setattr(*(torch, 'testing', None))", "`setattr` with unpacked arguments"),
    ("import torch as _torch\n_torch.testing.assert_close = print", "changes `_torch`"),
    ("from torch import testing\ntesting.assert_close = print", "changes `testing`"),
    ("x = (1).__class__", "dunder attributes"),
    ("os._exit(0)", "reaches the interpreter or the process"),
    ("os.execv('/bin/true', ['true'])", "reaches the interpreter or the process"),
    ("def g():\n    yield\nframe = g().gi_frame", "reaches the interpreter or the process"),
    ("__builtins__['len'] = None", "interpreter's internals"),
])
def test_changing_the_interpreter_is_refused(line, expected):
    assert expected in messages(REFERENCE_FUNCTION + "\n" + line)


@pytest.mark.parametrize(("code", "expected"), [
    ("class Same(list):\n    pass", "derives from `list`"),
    ("class Same:\n    def __eq__(self, other):\n        return True", "defines `__eq__`"),
    ("class Same:\n    def __bool__(self):\n        return True", "defines `__bool__`"),
    ("class Same:\n    __eq__ = lambda self, other: True", "sets a dunder attribute"),
])
def test_lying_objects_are_refused(code, expected):
    assert expected in messages(REFERENCE_FUNCTION + "\n" + code)


def test_module_surgery_on_the_answers_own_objects_is_allowed():
    answer = (REFERENCE_FUNCTION + "\n\ndef swap(model, name, layer):\n    setattr(model, name, layer)\n"
              "    parent = model\n    setattr(parent.blocks[0], 'mlp', layer)\n    return getattr(model, name)\n")
    assert audit(answer, REFERENCE_FUNCTION, CONTEXT) == []


def test_names_a_test_cell_declares_off_limits_are_refused_however_imported():
    tests = "# Not in the answer: torch.nn.parallel.DistributedDataParallel (what the tests compare with)"
    for answer in ("from torch.nn.parallel import DistributedDataParallel as DDP\n",
                   "import torch.nn.parallel\nwrapped = torch.nn.parallel.DistributedDataParallel\n"):
        found = audit(REFERENCE_FUNCTION + "\n" + answer, REFERENCE_FUNCTION, CONTEXT, tests)
        assert any("DistributedDataParallel" in v.message and "tests compare" in v.message for v in found), found


def test_what_the_reference_does_is_allowed():
    reference = "def save(path, state):\n    tmp = str(path) + '.tmp'\n    torch.save(state, tmp)\n    os.replace(tmp, path)\n" \
                "    os.environ['SAVED'] = '1'"
    assert audit(reference, reference, CONTEXT) == []


def test_each_violation_names_its_line():
    (violation,) = audit(REFERENCE_FUNCTION + "\nimport sys\n", REFERENCE_FUNCTION, CONTEXT)
    assert violation.line == REFERENCE_FUNCTION.count("\n") + 2
    assert str(violation).startswith(f"line {violation.line}: ")


def test_a_syntax_error_is_reported():
    (violation,) = audit("def causal_attention(:\n", REFERENCE_FUNCTION, CONTEXT)
    assert "SyntaxError" in violation.message


def test_what_the_tests_compare_with_is_refused():
    reference = "def shard(n, rank, world):\n    return list(range(rank, n, world))"
    tests = "assert shard(10, 1, 4) == list(DistributedSampler(range(10), 4, 1, shuffle=False))\nassert torch.ones(1)"
    answer = "def shard(n, rank, world):\n    return list(DistributedSampler(range(n), world, rank, shuffle=False))"
    (violation,) = audit(answer, reference, CONTEXT, tests)
    assert "`DistributedSampler` is what the tests compare your answer with" in violation.message
    assert audit("def shard(n, rank, world):\n    return torch.arange(rank, n, world).tolist()", reference, CONTEXT,
                 tests) == []  # a module the tests use (torch) stays available


def test_a_test_cell_can_declare_what_answers_may_not_use():
    reference = "def scaled(optimizer, state):\n    optimizer.step()\n    return True"
    tests = "# Not in the answer: torch.amp.GradScaler (what the tests compare with).\nassert scaled(opt, {})"
    answer = "def scaled(optimizer, state):\n    scaler = torch.amp.GradScaler('cpu')\n    scaler.step(optimizer)\n    return True"
    (violation,) = audit(answer, reference, CONTEXT, tests)
    assert "`torch.amp.GradScaler` is what the tests compare your answer with" in violation.message
    aliased = "from torch.amp import GradScaler\ndef scaled(optimizer, state):\n    return GradScaler('cpu') is None"
    assert any("GradScaler" in v.message for v in audit(aliased, reference, CONTEXT, tests))
    assert audit(reference, reference, CONTEXT, tests) == []

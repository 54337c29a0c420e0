"""What judges a graded check cannot be replaced under it.

A graded check runs the learner's answer and then the exercise's tests in one process (and the answer's
functions in the ranks the tests start), so an answer could replace what the tests judge with instead of
passing them: `torch.testing.assert_close`, `math.isclose`, a collective the tests count, the course_lib
reference they compare with. `Snapshot.take()` records, before the answer runs, every function, class and
module reachable as an attribute of the watched modules (torch, torch.testing, torch.distributed and
every loaded submodule of it, torch.nn, math, numpy, builtins, course_lib ...), the methods of the classes
the checks rely on (torch.Tensor, torch.nn.Module) and the names of the notebook's setup cells;
`snapshot.verify(when)` raises IntegrityError naming every one that is no longer the same object:

    snapshot = Snapshot.take(namespace, setup_names)
    ...                                   # the answer runs
    snapshot.verify("after the answer ran")

Identity, not equality, and the objects themselves: a replacement is caught whatever made it: an alias
(`import torch as t; t.testing.assert_close = ...`), `setattr`, `module.__dict__[...]`, or code loaded at
run time (`torch.hub.load`, a file the answer wrote and imported). Values that are state (numbers, dicts,
tensors) are not watched: a library's counters change while it runs. New attributes are allowed (a lazy
import adds its submodule to its package).

A patch that undoes itself before the snapshot is verified (it replaces a function, the tests call the fake
once, the fake puts the original back) leaves nothing to see afterwards, so `guard_modules()` also refuses the
replacement as it happens: every watched module refuses to rebind a function, class or module while code that
is not trusted is running (on the call stack): trusted is course_lib and course_tools, the Python installation
(standard library, torch and the other installed packages) and the files `trust()` names (the notebook's setup
and test cells).
The learner's answer, the modules ranks import it from, and whatever it loads at run time are not trusted.

The grading sandbox takes a snapshot and guards the modules in every check, and names `graded_rank` in
course_lib.runtime.launch's RANK_CONTEXT_VARIABLE, so that every rank the check launches does the same around
its worker (the learner's library never imports the grading: the launcher loads what the variable names).
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import types
import warnings
from contextlib import contextmanager

import course_lib

RANK_CONTEXT = f"{__name__}:graded_rank"
"""What the grading sandbox sets course_lib.runtime.launch.RANK_CONTEXT_VARIABLE to."""
"""Set to 1 by the grading sandbox: each rank a graded check launches verifies a snapshot after its worker."""

WATCHED_MODULES = ("builtins", "math", "cmath", "operator", "functools", "itertools", "copy", "random", "os",
                   "os.path", "numpy", "torch", "torch.nn", "torch.optim", "torch.autograd", "torch.amp",
                   "torch.utils.data", "unittest", "unittest.mock")
WATCHED_PACKAGES = ("torch.testing", "torch.distributed", "torch.nn.functional", "torch.nn.parallel",
                    "numpy.testing", "course_lib", "course_tools")
"""Every loaded module of these packages is watched, the package itself included."""


class IntegrityError(AssertionError):
    """Something the checks judge with was replaced while the answer or the tests ran."""


def _judges(value) -> bool:
    """Functions, classes, modules and other callables: what a check calls. Not state."""
    return isinstance(value, types.ModuleType) or callable(value)


def _watched_modules() -> dict[str, types.ModuleType]:
    found = {}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType):
            continue
        if name in WATCHED_MODULES or any(name == p or name.startswith(p + ".") for p in WATCHED_PACKAGES):
            found[name] = module
    return found


def _watched_classes() -> dict[str, type]:
    classes = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        classes.update({"torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module,
                        "torch.nn.Parameter": torch.nn.Parameter})
    return classes


def _is_module_table(table: dict) -> bool:
    module = sys.modules.get(table.get("__name__", "")) if isinstance(table, dict) else None
    return module is not None and vars(module) is table and table.get("__name__") != "__main__"


class Snapshot:
    """The objects the checks judge with, as they are now (see the module docstring)."""

    def __init__(self, entries: dict[str, tuple[dict, str, object]]):
        self.entries = entries  # label -> (the dict it lives in, key, the object)

    @classmethod
    def take(cls, namespace: dict | None = None, names=()) -> "Snapshot":
        """Record the watched modules' and classes' callables, and `names` of `namespace` (the setup cells')."""
        with warnings.catch_warnings():  # looking at a deprecated alias (torch.distributed.reduce_op) warns
            warnings.simplefilter("ignore")
            return cls(cls._entries(namespace, names))

    @staticmethod
    def _entries(namespace, names) -> dict:
        entries = {}
        for module_name, module in _watched_modules().items():
            table = vars(module)
            for key, value in list(table.items()):
                if not key.startswith("__") and _judges(value):
                    entries[f"{module_name}.{key}"] = (table, key, value)
        for class_name, klass in _watched_classes().items():
            for key in dir(klass):  # what an attribute lookup finds, base classes included (getattr_static binds
                value = inspect.getattr_static(klass, key, None)  # nothing: the same object at every lookup)
                if value is not None and not key.startswith("__"):
                    entries[f"{class_name}.{key}"] = (klass, key, value)
        if namespace is not None:
            for name in names:
                if name in namespace and not name.startswith("__"):
                    entries[name] = (namespace, name, namespace[name])
        return entries

    def changed(self, names: bool = True) -> list[str]:
        """The labels of the recorded objects that are no longer there, or no longer the same object; with
        names=False, only those of modules and classes (tests may rebind their own names)."""
        missing = object()
        found = []
        for label, (where, key, value) in self.entries.items():
            if isinstance(where, type):
                now = inspect.getattr_static(where, key, missing)
            elif not names and not _is_module_table(where):
                continue
            else:
                now = where.get(key, missing)
            if now is not value:
                found.append(label)
        return found

    def verify(self, when: str, names: bool = True) -> None:
        """Raise IntegrityError naming every replaced object (see changed)."""
        changed = self.changed(names)
        if changed:
            shown = ", ".join(f"`{label}`" for label in changed[:10]) + (
                f" and {len(changed) - 10} more" if len(changed) > 10 else "")
            raise IntegrityError(
                f"{when}, {shown} {'is' if len(changed) == 1 else 'are'} no longer what the notebook's setup "
                "gave the checks: an answer may change only its own objects, never a module, a class of torch "
                "or a name of the setup cells (whatever the way: an alias, setattr, code loaded at run time)")


# ------------------------------------------------------------------ refusing a replacement as it happens

_TRUSTED_FILES: set[str] = set()
_MISSING = object()


def trust(path) -> None:
    """Code in this file may rebind what the checks judge with (a notebook's setup and test cells)."""
    _TRUSTED_FILES.add(os.path.abspath(str(path)))


def _trusted_roots() -> tuple[str, ...]:
    roots = {os.path.dirname(os.path.abspath(course_lib.__file__)),  # course_lib
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # course_tools
             sys.prefix, sys.base_prefix,
             *(sysconfig.get_paths().get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return tuple(os.path.abspath(root) + os.sep for root in roots if root)


_STARTS_A_PROCESS = {"spawn_main", "multiprocessing.forkserver"}
"""Names the `-c` command of a multiprocessing spawn or fork-server child calls: its outermost frame is trusted."""


def untrusted_caller() -> str | None:
    """The file of the innermost frame on the call stack whose code is not trusted, or None."""
    roots = _trusted_roots()
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<"):
            # the import system; and the `python -c` line that starts a spawned or fork-server process (the
            # outermost frame of every rank on macOS); other <string> and the like are exec'd code
            trusted = filename.startswith("<frozen") or (frame.f_back is None and filename == "<string>" and
                                                         _STARTS_A_PROCESS & set(frame.f_code.co_names))
        else:
            path = os.path.abspath(filename)
            trusted = path in _TRUSTED_FILES or path.startswith(roots)
        if not trusted:
            return filename
        frame = frame.f_back
    return None


def _check_write(module: types.ModuleType, name: str) -> None:
    current = vars(module).get(name, _MISSING)
    if current is _MISSING or name.startswith("__") or not _judges(current):
        return  # a new attribute, or state
    culprit = untrusted_caller()
    if culprit is not None:
        raise IntegrityError(f"`{module.__name__}.{name}` is what the checks judge with; code in {culprit} may not "
                             "replace it (an answer may change only its own objects)")


class _GuardedModule(types.ModuleType):
    """A watched module while a check runs: see guard_modules."""

    def __setattr__(self, name, value):
        _check_write(self, name)
        super().__setattr__(name, value)

    def __delattr__(self, name):
        _check_write(self, name)
        super().__delattr__(name)


def guard_modules() -> int:
    """Make every watched module refuse, from untrusted code, to rebind what the checks judge with. For a process
    that ends with the check (the sandbox's forked child, a rank): nothing undoes it. Returns how many modules."""
    guarded = 0
    for module in _watched_modules().values():
        if type(module) is types.ModuleType:
            module.__class__ = _GuardedModule
            guarded += 1
    return guarded


def settle_torch() -> None:
    """Import what torch imports lazily and that rebinds what the checks judge with: torch._dynamo, which torch
    imports at the first optimizer a process builds, wraps torch.manual_seed and others as it loads. Loaded before
    the snapshot, so that the learner's first optimizer is not taken for a replacement (and once per process:
    about a second)."""
    import torch
    import torch._dynamo  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


@contextmanager
def graded_rank(rank: int):
    """Around the worker of every rank a graded check launches: a snapshot, the guard, and the snapshot verified
    once the worker returned (an IntegrityError fails the rank, and the launcher stops the others). A rank
    forked from the check has torch settled already; a spawned one (macOS) settles it here."""
    settle_torch()
    snapshot = Snapshot.take()
    guard_modules()
    yield
    snapshot.verify(f"on rank {rank}, after the worker ran")

"""Run functions written in a notebook cell on real ranks.

Spawned ranks are fresh interpreters that import their worker, and everything passed to it, by module
path; a function defined in a notebook cell lives only in the notebook's memory, so it cannot reach
them (course_lib.runtime.launch refuses it with a TypeError). `spawnable(fn)` writes the function's source into
a module file in a temporary folder on sys.path (spawned ranks inherit the caller's sys.path), imports
it from there, and returns that importable copy:

    from course_lib import launch
    from course_lib.runtime.spawn import spawnable
    from course_lib.data_parallel.workers import check_gradient_averaging

    def data_parallel_backward(model, idx):          # in a notebook cell
        ...
    ranks = launch(check_gradient_averaging, 3, args=(spawnable(data_parallel_backward),))

The copy runs in a module whose only globals are the names of SPAWNABLE_IMPORTS (math, nullcontext,
torch, dist, nn, F) and the builtins. A function that uses any other notebook name, a lambda, a closure
or a function whose source cannot be found is refused at once with an error that says why.

Tracebacks name the copy `<notebook function NAME>` (display_name), with the line numbers of the cell it was
written in, never the temporary file the ranks import it from:

    File "<notebook function break_rank_2>", line 9, in break_rank_2
        raise RuntimeError(f"simulated failure in rank {rank} at step {step}")

`call(fn, *args)` is the plain worker: it runs any spawnable function on every rank.
`single_process_group()` gives one process a one-rank gloo group (enough for DistributedDataParallel).
"""

from __future__ import annotations

import atexit
import builtins
import dis
import glob
import hashlib
import importlib
import inspect
import os
import shutil
import sys
import tempfile
import textwrap
import types
from contextlib import contextmanager

import torch.distributed as dist

SPAWNABLE_IMPORTS = (
    "import math",
    "from contextlib import nullcontext",
    "import torch",
    "import torch.distributed as dist",
    "import torch.nn as nn",
    "import torch.nn.functional as F",
)
"""The module a spawnable function runs in starts with exactly these lines."""


_AVAILABLE = frozenset({"math", "nullcontext", "torch", "dist", "nn", "F"})


_FOLDER_PREFIX = "course-notebook-functions-"
_module_dir: str | None = None


def _global_names(code: types.CodeType) -> set[str]:
    """Global names a function's code (and the code nested in it: comprehensions, inner defs) reads or writes."""
    names = {ins.argval for ins in dis.get_instructions(code)
             if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _remove_folders_of_ended_processes() -> None:
    """A kernel that is killed never runs atexit: the next caller removes the folders it left behind."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{_FOLDER_PREFIX}*-*")):
        pid = os.path.basename(folder)[len(_FOLDER_PREFIX):].split("-")[0]
        try:
            if pid.isdigit() and os.stat(folder).st_uid == os.getuid():
                os.kill(int(pid), 0)  # raises ProcessLookupError when that process has ended
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass  # gone already, or alive and someone else's


def _functions_folder() -> str:
    global _module_dir
    if _module_dir is None:
        _remove_folders_of_ended_processes()
        _module_dir = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, _module_dir, ignore_errors=True)
    if _module_dir not in sys.path:
        sys.path.append(_module_dir)  # appended: never shadows a real module
    return _module_dir


def display_name(fn) -> str:
    """The file name tracebacks show for spawnable(fn)'s code: `<notebook function NAME>`."""
    return f"<notebook function {fn.__name__}>"


def _module_text(name: str, source: str) -> str:
    """The module file of a spawnable copy: SPAWNABLE_IMPORTS, then the function's source compiled under `name`
    (registered in linecache, so tracebacks quote its lines in every process that imports it); the helper names
    are deleted, so the function's globals are the imports alone."""
    return "\n".join([
        f'"""{name}: a copy made by course_lib.runtime.spawn.spawnable."""',
        *SPAWNABLE_IMPORTS,
        "import linecache as _linecache",
        "",
        f"_SOURCE = {source!r}",
        f"_NAME = {name!r}",
        "_linecache.cache[_NAME] = (len(_SOURCE), None, _SOURCE.splitlines(keepends=True), _NAME)",
        "exec(compile(_SOURCE, _NAME, 'exec'), globals())",
        "del _linecache, _SOURCE, _NAME",
        "",
    ])


def _importable_as_is(fn) -> bool:
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    return (module is not None and module.__name__ != "__main__" and getattr(module, "__file__", None) is not None
            and "<locals>" not in fn.__qualname__ and getattr(module, fn.__qualname__, None) is fn)


def spawnable(fn):
    """An importable copy of the plain function `fn` (e.g. one defined in a notebook cell), for launch().

    Functions that already live in an importable module are returned unchanged. Raises TypeError for
    anything but a plain `def` function (lambdas, closures, methods, builtins), ValueError when its
    source cannot be found or it uses names the ranks will not have (see SPAWNABLE_IMPORTS).
    """
    name = getattr(fn, "__qualname__", repr(fn))
    if not inspect.isfunction(fn):
        raise TypeError(f"spawnable needs a function defined with `def`, got {type(fn).__name__} {name!r}")
    if fn.__name__ == "<lambda>":
        raise TypeError("spawnable cannot send a lambda to the ranks: its source is part of a larger "
                        "expression. Define the function with `def name(...):` in its own cell.")
    if fn.__code__.co_freevars:
        raise TypeError(f"{name} is a closure: it uses {list(fn.__code__.co_freevars)} from the function that "
                        "defines it, which the ranks cannot see. Define it at the top level of a cell and pass "
                        "those values as arguments.")
    if _importable_as_is(fn):
        return fn
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as err:
        raise ValueError(f"cannot find the source code of {name} ({err}); spawnable copies a function's text "
                         "into a module file, so define it in a notebook cell or a .py file") from None
    missing = sorted(_global_names(fn.__code__) - _AVAILABLE - set(dir(builtins)) - {fn.__name__})
    if missing:
        raise ValueError(
            f"{name} uses {missing}, which the ranks will not have: a spawned rank sees only "
            f"{', '.join(sorted(_AVAILABLE))} and the builtins. Import or define what it needs inside "
            "the function body.")
    # Blank lines before the source keep the cell's line numbers: line 9 of a traceback is line 9 of the cell.
    source = "\n" * (fn.__code__.co_firstlineno - 1) + source
    text = _module_text(display_name(fn), source)
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    module_name = f"_notebook_{fn.__name__}_{digest}"
    path = os.path.join(_functions_folder(), f"{module_name}.py")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)  # no rank can ever import a half-written file
        importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(f"the source of {name} does not run on its own in a module ({type(err).__name__}: "
                         f"{err}); written to {path}") from err
    copy = getattr(module, fn.__name__, None)
    if not inspect.isfunction(copy):
        raise ValueError(f"the source found for {name} does not define a function named {fn.__name__!r}")
    return copy


@contextmanager
def single_process_group():
    """A one-rank gloo process group in this process (enough for DistributedDataParallel), removed on exit."""
    if dist.is_initialized():  # someone already made one: use it, leave it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def call(fn, *args, **kwargs):
    """Worker: fn(*args, **kwargs) on every rank, e.g. launch(call, 2, args=(spawnable(my_function),))."""
    return fn(*args, **kwargs)

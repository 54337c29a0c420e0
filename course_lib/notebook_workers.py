"""Run functions written in a notebook cell on real ranks, and the rank workers that grade them.

Spawned ranks are fresh interpreters that import their worker, and everything passed to it, by module
path; a function defined in a notebook cell lives only in the notebook's memory, so it cannot reach
them (course_lib.launch refuses it with a TypeError). `spawnable(fn)` writes the function's source into
a module file in a temporary folder on sys.path (spawned ranks inherit the caller's sys.path), imports
it from there, and returns that importable copy:

    from course_lib.launch import launch
    from course_lib.notebook_workers import check_gradient_averaging, spawnable

    def data_parallel_backward(model, idx):          # in a notebook cell
        ...
    ranks = launch(check_gradient_averaging, 3, args=(spawnable(data_parallel_backward),))

The copy runs in a module whose only globals are the names of SPAWNABLE_IMPORTS (math, nullcontext,
torch, dist, nn, F) and the builtins. A function that uses any other notebook name, a lambda, a closure
or a function whose source cannot be found is refused at once with an error that says why.

`call(fn, *args)` is the plain worker: it runs any spawnable function on every rank. The check_* workers
run a learner's function on every rank next to DDP; gradient_averaging_reference and
train_steps_one_process compute, in one process and with course_lib's code, what the ranks must match.
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

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from course_lib.model import GPT, GPTConfig
from course_lib.optim import make_scheduler
from course_lib.steps import train_step as reference_train_step

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


# ------------------------------------------------------------------ notebook functions on ranks

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
    text = "\n".join(SPAWNABLE_IMPORTS) + "\n\n\n" + source
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


# ------------------------------------------------------------------ shared set-up

def _tiny_model(seed: int, frozen: tuple[str, ...] = ()) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset("tiny"))
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def _batches(count: int, rows: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """The same `count` global batches of token ids on every rank; each rank then takes its own rows."""
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, 256, (rows, seq_len), generator=generator) for _ in range(count)]


def _my_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.size(0) // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ gradient averaging

FROZEN = ("blocks.0.attn.q_proj.weight", "norm_f.weight")
"""Parameters frozen in the second case of the gradient check: their .grad stays None."""


def check_gradient_averaging(backward_fn, *, rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """Worker: each rank calls backward_fn(model, its rows) on identical replicas; returns what it left in .grad.

    Two cases: every parameter trainable ("all"), and FROZEN parameters without gradients ("frozen").
    A case that raises is reported as {"error": ...} so the other case is still checked.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"rank": rank, "world_size": world_size}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _tiny_model(seed, frozen)
        rows = _my_rows(_batches(1, rows_per_rank * world_size, seq_len, seed)[0], rank, world_size)
        try:
            loss = backward_fn(model, rows)
        except Exception as err:  # noqa: BLE001 (reported to the caller, which fails the check)
            results[case] = {"error": f"{type(err).__name__}: {err}"}
            continue
        with torch.no_grad():
            local_loss = model(rows, targets=rows)[1].item()
        results[case] = {"error": None, "grads": _grads(model), "local_loss": local_loss,
                         "returned_loss": float(loss) if isinstance(loss, (torch.Tensor, float, int)) else loss}
    return results


def gradient_averaging_reference(world_size: int, *, rows_per_rank: int = 2, seq_len: int = 16,
                                 seed: int = 0) -> dict:
    """One process, the whole global batch: the gradients every rank must hold after averaging."""
    reference = {}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _tiny_model(seed, frozen)
        batch = _batches(1, rows_per_rank * world_size, seq_len, seed)[0]
        model(batch, targets=batch)[1].backward()
        reference[case] = _grads(model)
    return reference


# ------------------------------------------------------------------ train_step under DDP

def _step_setup(seed: int, lr: float, steps: int):
    model = _tiny_model(seed)
    # SGD, not AdamW: its update is proportional to the gradient, so a wrong scale shows in the weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = make_scheduler(optimizer, max_lr=lr, min_lr=lr / 10, warmup_steps=1, max_steps=steps)
    return model, optimizer, scheduler


def check_train_step(train_step_fn, *, steps: int = 3, grad_accum_steps: int = 3, micro_batch: int = 1,
                     seq_len: int = 16, lr: float = 0.5, seed: int = 0) -> dict:
    """Worker: `steps` calls of train_step_fn on a DDP model, passing no_sync=ddp.no_sync.

    Returns this rank's records (what train_step_fn returned), final weights, and the all-reduces DDP
    launched in each step next to the number one synchronised backward launches.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = _step_setup(seed, lr, steps)
    ddp = DistributedDataParallel(model)
    launched = []

    def counting_allreduce(state, bucket):
        launched.append(bucket.index())
        return allreduce_hook(None, bucket)  # DDP's own averaging all-reduce, counted

    ddp.register_comm_hook(None, counting_allreduce)
    batches = _batches(steps * grad_accum_steps, micro_batch * world_size, seq_len, seed)
    records, allreduces_per_step = [], []
    for step in range(steps):
        micro_batches = [_my_rows(b, rank, world_size) for b in batches[step * grad_accum_steps:][:grad_accum_steps]]
        before = len(launched)
        records.append(train_step_fn(ddp, micro_batches, optimizer, scheduler, no_sync=ddp.no_sync))
        allreduces_per_step.append(len(launched) - before)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    # One ordinary synchronised backward: how many all-reduces "communicate once" means for this model.
    before = len(launched)
    ddp(micro_batches[0], targets=micro_batches[0])[1].backward()
    return {"rank": rank, "world_size": world_size, "records": records, "params": params,
            "allreduces_per_step": allreduces_per_step, "allreduces_per_backward": len(launched) - before}


def train_steps_one_process(train_step_fn=None, world_size: int = 2, *, steps: int = 3, grad_accum_steps: int = 3,
                            micro_batch: int = 1, seq_len: int = 16, lr: float = 0.5, seed: int = 0,
                            grad_clip: float | None = None) -> dict:
    """The same steps in one process, every rank's rows in each micro-batch (default: course_lib's train_step).

    With world_size ranks of `micro_batch` rows each, this is what check_train_step's ranks must match.
    """
    train_step_fn = train_step_fn or reference_train_step
    model, optimizer, scheduler = _step_setup(seed, lr, steps)
    batches = _batches(steps * grad_accum_steps, micro_batch * world_size, seq_len, seed)
    records = [train_step_fn(model, batches[step * grad_accum_steps:][:grad_accum_steps], optimizer, scheduler,
                             grad_clip=grad_clip)
               for step in range(steps)]
    return {"records": records, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}

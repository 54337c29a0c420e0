"""Tensors handed to collectives must live on the rank's device: checked in the source, and at run time.

On a GPU node a rank's process group is NCCL for CUDA tensors (with gloo beside it, env.CUDA_BACKEND). A tensor
built on the CPU and all-reduced (a loss for the log, a timing) then either fails (an NCCL-only group has no
backend for CPU tensors) or takes the slow gloo path. Two guards keep course_lib free of that bug class:

- `host_tensor_collectives(paths)` reads the source: every collective (`dist.all_reduce(t)`, `dist.all_gather(ts, t)`,
  ...) whose tensor is made by a torch factory without `device=` (`torch.tensor([...])`, `torch.zeros(n)`), or by
  `.cpu()` / `.to("cpu")`, in the same function, is reported with its file and line. tests/runtime/test_device_guard.py
  runs it over course_lib and scripts on every `make test`.
- `guard_collectives(device)` checks at run time: inside it, a collective given a tensor on another device than
  `device` raises `DeviceMismatch` naming the collective, the tensor's device and the caller's line. `launch` turns
  it on in every rank when COURSE_DEVICE_GUARD=1 (`make gpu-check` runs the GPU tests that way).

    python -m course_lib.runtime.device_guard course_lib scripts     # exit 1 and one line per finding
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVES = {
    # name: positions of its tensor arguments (a list of tensors counts as a tensor argument)
    "all_reduce": (0,), "broadcast": (0,), "reduce": (0,), "send": (0,), "recv": (0,), "isend": (0,), "irecv": (0,),
    "all_gather": (0, 1), "all_gather_into_tensor": (0, 1), "reduce_scatter": (0, 1), "reduce_scatter_tensor": (0, 1),
    "all_gather_single": (0, 1), "reduce_scatter_single": (0, 1),  # torch 2.13's names of the two before them
    "all_to_all_single": (0, 1), "all_to_all": (0, 1), "scatter": (0, 1), "gather": (0, 1),
}
FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange", "linspace", "rand",
             "randn", "randint"}


class DeviceMismatch(RuntimeError):
    """A collective was given a tensor that is not on the rank's device."""


# ------------------------------------------------------------------------------------------ in the source
def _is_collective(func: ast.expr) -> bool:
    if not (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES):
        return False
    owner = func.value
    return (isinstance(owner, ast.Name) and owner.id == "dist") or (
        isinstance(owner, ast.Attribute) and owner.attr == "distributed")


def _made_on_the_host(expr: ast.expr) -> bool:
    """A torch factory call without device=, or .cpu() / .to("cpu")."""
    if isinstance(expr, ast.ListComp):
        return _made_on_the_host(expr.elt)
    if isinstance(expr, (ast.List, ast.Tuple)):
        return any(_made_on_the_host(e) for e in expr.elts)
    if not isinstance(expr, ast.Call) or not isinstance(expr.func, ast.Attribute):
        return False
    func = expr.func
    if isinstance(func.value, ast.Name) and func.value.id == "torch" and func.attr in FACTORIES:
        return not any(k.arg == "device" for k in expr.keywords)
    if func.attr == "cpu":
        return True
    return func.attr == "to" and bool(expr.args) and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == "cpu"


def host_tensor_collectives_in(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: collective(arg) gets arg = <expression>' for each collective fed a tensor made on the host."""
    findings = []
    for function in ast.walk(ast.parse(source, filename)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).append(node.value)
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and _is_collective(node.func)):
                continue
            for position in COLLECTIVES[node.func.attr]:
                if position >= len(node.args):
                    continue
                arg = node.args[position]
                sources = assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [arg]
                for made in sources:
                    if _made_on_the_host(made):
                        findings.append(f"{filename}:{node.lineno}: dist.{node.func.attr}({ast.unparse(arg)}) gets "
                                        f"{ast.unparse(arg)} = {ast.unparse(made)}: make it with device= the rank's "
                                        "device (get_dist_info().device)")
    return findings


def host_tensor_collectives(paths) -> list[str]:
    """host_tensor_collectives_in for every .py file under `paths` (files or folders)."""
    findings = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            findings += host_tensor_collectives_in(file.read_text(encoding="utf-8"), str(file))
    return findings


# ------------------------------------------------------------------------------------------ at run time
def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _caller() -> str:
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()[:-2]):
        if Path(frame.filename).resolve() != here and "torch" not in Path(frame.filename).parts:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class _Checked:
    """A collective that checks its tensors first, and is still equal to the collective it wraps: torch compares
    ops by equality (dist.P2POp(dist.isend, ...) accepts only isend and irecv themselves)."""

    def __init__(self, collective, check):
        functools.update_wrapper(self, collective)
        self.collective, self.check = collective, check

    def __call__(self, *args, **kwargs):
        self.check(args)
        return self.collective(*args, **kwargs)

    def __eq__(self, other):
        return other is self or other is self.collective

    def __hash__(self):
        return hash(self.collective)


@contextlib.contextmanager
def guard_collectives(device: torch.device | str):
    """Inside: every collective of COLLECTIVES raises DeviceMismatch when a tensor it is given is not on `device`
    (compared by device type: cuda:0 and cuda:1 are both GPUs of some rank)."""
    expected = torch.device(device).type
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def checked(name, collective):
        def check(args):
            for position in COLLECTIVES[name]:
                if position < len(args):
                    for tensor in _tensors(args[position]):
                        if tensor.device.type != expected:
                            raise DeviceMismatch(
                                f"dist.{name} at {_caller()} was given a tensor on {tensor.device}, but this rank's "
                                f"device is {device}: make it with device=get_dist_info().device")
        return _Checked(collective, check)

    p2p_op = dist.P2POp

    class CheckedP2POp(p2p_op):
        """dist.P2POp with its tensor checked; it keeps the original isend/irecv, which batch_isend_irecv
        tells apart by identity."""

        def __new__(cls, op, tensor, *args, **kwargs):
            return super().__new__(cls, getattr(op, "collective", op), tensor, *args, **kwargs)

        def __init__(self, op, tensor, *args, **kwargs):
            op = getattr(op, "collective", op)
            checked(op.__name__, op).check((tensor,))
            super().__init__(op, tensor, *args, **kwargs)

    for name, collective in originals.items():
        setattr(dist, name, checked(name, collective))
    dist.P2POp = CheckedP2POp
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
        dist.P2POp = p2p_op


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or ["course_lib", "scripts"]
    findings = host_tensor_collectives(paths)
    print("\n".join(findings) if findings else f"every collective in {', '.join(paths)} gets tensors made on the "
          "rank's device")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every collective a process runs, seen where all roads meet, and refused by effect rather than by name.

`dist.all_reduce`, `torch.distributed.distributed_c10d.all_reduce`, a `ProcessGroup`'s own `allreduce`, the
functional collectives under DTensor (`torch.distributed._functional_collectives`), a backend's methods called
directly (`pg._get_backend(device).allreduce`): every way of running a collective from Python ends either in
an operator of torch's dispatcher (`c10d.allreduce_`, `_c10d_functional.all_reduce`, ...) or in a method of
torch's `Backend` class (gloo's and NCCL's backends derive from it). `process_group_calls()` watches both while
a block runs, with a dispatch mode and by wrapping the Backend methods, so an exercise's worker can record what
really went over the network, and refuse what the exercise forbids:

    with process_group_calls(refused=COLLECTIVES, reason="build the ring from isend/recv") as calls:
        ring_fn(tensor)
    sent = sum(call.elements for call in calls if call.kind == "send")

A refused kind raises CollectiveRefused before anything is sent. Each Call has a `kind` (allreduce, allgather,
reduce_scatter, broadcast, reduce, alltoall, gather, scatter, send, recv, barrier), the operator or method that
ran, and the elements of the tensors it was given.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._C import _distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall", "gather", "scatter")
"""The kinds of call that move data between all the ranks of a group."""
POINT_TO_POINT = ("send", "recv")
NAMESPACES = ("c10d", "_c10d_functional")
_SYNONYMS = {"all_reduce": "allreduce", "all_gather": "allgather", "all_to_all": "alltoall", "recv_any_source": "recv",
             "recv_anysource": "recv", "monitored_barrier": "barrier"}
_BACKEND_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                    "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
                    "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base", "gather",
                    "scatter", "send", "recv", "recv_anysource", "barrier")


class CollectiveRefused(RuntimeError):
    """The exercise forbids this kind of collective, by whatever road it was reached."""


@dataclass
class Call:
    kind: str        # allreduce, allgather, reduce_scatter, ..., send, recv, barrier
    name: str        # the operator or Backend method that ran, e.g. "c10d.allreduce_"
    elements: int    # elements of the tensors it was given


def kind_of(name: str) -> str | None:
    """The kind of a dispatcher operator or Backend method name ("c10d._allgather_base_" -> "allgather"), or None
    for what moves no data between ranks (wait_tensor, ...)."""
    base = name.rsplit(".", 1)[-1].strip("_")
    for suffixes in (("_coalesced", "_base"), ("_into_tensor", "_tensor", "_single")):
        for suffix in suffixes:
            base = base.removesuffix(suffix)
    base = _SYNONYMS.get(base.strip("_"), base.strip("_"))
    return base if base in (*COLLECTIVES, *POINT_TO_POINT, "barrier") else None


def _elements(args) -> int:
    total = 0
    for arg in args:
        if isinstance(arg, torch.Tensor):
            total += arg.numel()
        elif isinstance(arg, (list, tuple)):
            total += _elements(arg)
    return total


class _Gate:
    def __init__(self, refused, reason: str):
        self.refused, self.reason, self.calls = set(refused), reason, []

    def see(self, name: str, args) -> None:
        kind = kind_of(name)
        if kind is None:
            return
        if kind in self.refused:
            raise CollectiveRefused(f"{self.reason} ({kind} reached through {name})")
        self.calls.append(Call(kind, name, _elements(args)))


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, gate: _Gate):
        super().__init__()
        self.gate = gate

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in NAMESPACES:
            self.gate.see(f"{func.namespace}.{func._opname}", args)
        return func(*args, **(kwargs or {}))


@contextmanager
def process_group_calls(refused=(), reason: str = "the exercise asks you to write this collective yourself"):
    """Record every collective and point-to-point call this thread makes while the block runs (yields the list of
    Call, filled as they happen); kinds named in `refused` raise CollectiveRefused(reason) instead of running."""
    gate = _Gate(refused, reason)
    originals = []
    for method in _BACKEND_METHODS:  # a backend called directly does not go through the dispatcher
        real = c10d.Backend.__dict__.get(method)
        if real is not None:
            originals.append((method, real))
            setattr(c10d.Backend, method, _backend_method(method, real, gate))
    try:
        with _DispatchWatch(gate):
            yield gate.calls
    finally:
        for method, real in originals:
            setattr(c10d.Backend, method, real)


def _backend_method(method: str, real, gate: _Gate):
    def call(self, *args, **kwargs):
        gate.see(f"Backend.{method}", args)
        return real(self, *args, **kwargs)
    call.__name__ = method
    return call

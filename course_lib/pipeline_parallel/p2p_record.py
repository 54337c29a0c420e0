"""Count a rank's point-to-point messages: torch.distributed's send, recv, isend, irecv (and batch_isend_irecv,
which calls isend and irecv) recorded as (peer, tag, bytes), in call order.

    with record_p2p() as record:
        run_stage(...)
    record.sent, record.received, record.bytes_sent(peer=1)

Nothing changes in how the messages travel. The pipeline exercise's check uses it to see which neighbour got which
bytes. Every message must name its peer rank: a receive from any source is refused, as a pipeline always knows
whom it waits for.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib.runtime import launch as _launch

# `where` (the launcher's hang report) skips these frames: it names the line of the stage's code that sent.
_launch.NOT_THE_WORKERS_CODE.add(os.path.abspath(__file__))

_ORIGINAL = {name: getattr(c10d, name) for name in ("send", "recv", "isend", "irecv")}


@dataclass
class Record:
    """This rank's messages: (peer's global rank, tag, bytes) per send and per receive, in call order."""

    sent: list = field(default_factory=list)
    received: list = field(default_factory=list)

    def bytes_sent(self, peer: int | None = None) -> int:
        return sum(size for p, _, size in self.sent if peer is None or p == peer)


def _global_peer(group, peer, group_peer, what: str) -> int:
    if peer is None and group_peer is None:
        side = "src" if what == "receive" else "dst"
        raise ValueError(f"a {what} must name its peer rank: {side}= is missing")
    if group_peer is not None:
        return dist.get_global_rank(group if group is not None else c10d._get_default_group(), group_peer)
    return peer


def _size(tensor) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"point-to-point messages carry tensors, got {type(tensor).__name__}")
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def record_p2p():
    """Inside, every send/recv/isend/irecv of this process is recorded; yields the Record."""
    record = Record()
    inside: list = []

    def recorded(name: str, log: list, what: str):
        original = _ORIGINAL[name]
        peer_key = "src" if what == "receive" else "dst"

        def call(tensor, *args, **kwargs):
            if inside:  # torch's recv calls irecv, its send isend: the outer call is the message
                return original(tensor, *args, **kwargs)
            bound = dict(zip((peer_key, "group", "tag", f"group_{peer_key}"), args), **kwargs)
            peer = _global_peer(bound.get("group"), bound.get(peer_key), bound.get(f"group_{peer_key}"), what)
            log.append((peer, bound.get("tag", 0), _size(tensor)))
            inside.append(name)
            try:
                return original(tensor, *args, **kwargs)
            finally:
                inside.pop()
        call.__name__ = call.__qualname__ = name
        return call

    wrappers = {"send": recorded("send", record.sent, "send"), "isend": recorded("isend", record.sent, "send"),
                "recv": recorded("recv", record.received, "receive"),
                "irecv": recorded("irecv", record.received, "receive")}
    # P2POp checks `op in [isend, irecv]` against distributed_c10d's globals: patch them there and in dist.
    with contextlib.ExitStack() as stack:
        for name, wrapper in wrappers.items():
            stack.enter_context(mock.patch.object(c10d, name, wrapper))
            stack.enter_context(mock.patch.object(dist, name, wrapper))
        yield record

"""Rank workers that grade the sequence-parallel exercise (Session F, notebook 01b): the learner's region entrance
and exit around a tensor-parallel block whose norms run on this rank's positions only.

    ranks = launch(check_sequence_parallel_block, 2, args=(spawnable(sequence_parallel_regions),))
    reference = sequence_parallel_reference()

The worker takes the tiny GPT's first block (the tensor-parallel exercise's, course_lib.tensor_parallel.workers),
splits it with course_lib (apply_sequence_parallel_block) around the learner's `enter` and `leave`, gives it this
rank's positions of the input, runs forward and backward, and sums the norms' gradients over the ranks. It records
every collective (name, elements, forward or backward) and the bytes the two norms save for backward.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib.core.model import GPTConfig
from course_lib.memory.activations import count_saved_bytes, layer_terms
from course_lib.tensor_parallel.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    apply_sequence_parallel_block,
)
from course_lib.tensor_parallel.workers import tp_block, tp_block_input, tp_block_reference

NORMS = ("attn_norm", "mlp_norm")
RECORDED = ("all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_reduce",
            "all_to_all", "all_to_all_single", "broadcast", "send", "recv", "isend", "irecv")


def _count_norm_saves(block, saved: dict) -> None:
    """Wrap each norm's forward so that the bytes it saves for backward add up in saved[name]."""
    for name in NORMS:
        norm = getattr(block, name)
        original = norm.forward

        def forward(x, _original=original, _name=name, _norm=norm):
            with count_saved_bytes(exclude=list(_norm.parameters())) as counter:
                out = _original(x)
            saved[_name] = saved.get(_name, 0) + counter["bytes"]
            return out
        norm.forward = forward


def norm_formula_bytes(batch: int, seq_len: int) -> dict[str, int]:
    """What course_lib.memory.activations.layer_terms counts for each norm of the tiny GPT's block (tp_block) over
    seq_len positions: its fp32 input and its 1/rms per position."""
    terms = layer_terms(GPTConfig.from_preset("tiny"), batch, seq_len)
    return {name: sum(v for k, v in terms.items() if k.startswith(f"{name}:")) for name in NORMS}


def sequence_parallel_reference(seed: int = 0) -> dict:
    """One process, the whole block on the whole sequence (tp_block_reference), and the bytes its norms save."""
    reference = tp_block_reference(seed)
    block, cos, sin = tp_block(seed)
    x, _ = tp_block_input(seed)
    saved: dict = {}
    _count_norm_saves(block, saved)
    block(x.requires_grad_(), cos, sin)
    return {**reference, "norm_saved_bytes": saved, "norm_formula_bytes": norm_formula_bytes(*x.shape[:2])}


def _numel(name: str, args, kwargs) -> int:
    """Elements of the full (gathered or scattered) tensor of one collective call."""
    first = args[0] if args else next(iter(kwargs.values()))
    if name == "all_gather":  # (tensor_list, tensor)
        return sum(t.numel() for t in first)
    if name == "reduce_scatter":  # (output, input_list)
        second = args[1] if len(args) > 1 else kwargs.get("input_list", [])
        return sum(t.numel() for t in second)
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # (output, input): the input is the full tensor
        return (args[1] if len(args) > 1 else kwargs["input"]).numel()
    return first.numel()  # an all-gather's output is the full tensor; all_reduce's is the tensor


def check_sequence_parallel_block(make_fn, *, seed: int = 0) -> dict:
    """Worker: enter, leave = make_fn(); this rank's shards of the block with enter and leave placed; forward and
    backward on this rank's positions. Returns the output and input gradient of those positions, every parameter's
    gradient (the norms' summed over the ranks) and shape, every collective and the bytes the norms saved."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    block, cos, sin = tp_block(seed)
    x, upstream = tp_block_input(seed)
    if x.shape[1] % world_size:
        raise ValueError(f"the block's sequence of {x.shape[1]} positions does not divide over {world_size} ranks")
    n = x.shape[1] // world_size
    positions = slice(rank * n, (rank + 1) * n)
    x_local = x[:, positions].clone().requires_grad_()
    calls, saved = [], {}

    def recording(name):
        original = getattr(c10d, name)

        def call(*args, **kwargs):
            calls.append({"name": name, "numel": _numel(name, args, kwargs),
                          "phase": "backward" if torch._C._current_graph_task_id() != -1 else "forward"})
            return original(*args, **kwargs)
        return call

    patches = {name: recording(name) for name in RECORDED if hasattr(dist, name)}
    with mock.patch.multiple(dist, **patches), mock.patch.multiple(c10d, **patches):
        enter, leave = make_fn()
        apply_sequence_parallel_block(block, enter=enter, leave=leave)
        _count_norm_saves(block, saved)
        y = block(x_local, cos, sin)
        if not isinstance(y, torch.Tensor) or y.shape != x_local.shape:
            raise TypeError(f"the block should return this rank's positions, shape {tuple(x_local.shape)}, got "
                            f"{tuple(getattr(y, 'shape', ()))}: leave must hand back this rank's positions of the sum")
        (y * upstream[:, positions]).sum().backward()
    allreduce_sequence_parallel_grads(block)
    return {"rank": rank, "world_size": world_size, "positions": (positions.start, positions.stop),
            "y": y.detach(), "x_grad": x_local.grad,
            "grads": {name: None if p.grad is None else p.grad.clone() for name, p in block.named_parameters()},
            "calls": calls, "norm_saved_bytes": saved, "bsh": x.numel(),
            "norm_formula_bytes": norm_formula_bytes(x.shape[0], n)}

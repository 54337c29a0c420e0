"""The same tensor parallelism with torch's DTensor: a device mesh and a plan per block, no hand-written f and g.

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))       # "cuda" on GPUs
    parallelize_module(block, mesh, {"attn.q_proj": ColwiseParallel(), ..., "attn.o_proj": RowwiseParallel()})

ColwiseParallel shards a Linear's weight on dim 0 (Shard(0)) and returns this rank's slice of the output;
RowwiseParallel shards dim 1 and all-reduces the partial outputs (torch's g). The backward all-reduce (f) comes
from DTensor itself: the gradient of a replicated input of a sharded matmul is a *Partial* DTensor, and turning
it back into a replicated tensor is an all-reduce. Where that conversion happens decides how many all-reduces
run: per projection (q, k, v separately: 3 in attention's backward) or once per region when
PrepareModuleInput turns the region's input into a DTensor first (`plan(fuse_region_input=True)`, Megatron's
count of 2 forward + 2 backward per layer).

torch's Llama example divides `attention.n_heads` by the TP size because its forward reshapes with n_heads;
course_lib.core.model's attention infers the head count from the projection output, so nothing needs adjusting.

    from course_lib.runtime.launch import launch
    from course_lib.tensor_parallel.workers import dtensor_tp_run
    launch(dtensor_tp_run, world_size=2)

    python -m pytest -q tests/tensor_parallel/test_dtensor.py
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.core.model import GPT
from course_lib.runtime.env import backend_uses_cuda
from course_lib.tensor_parallel.tp_layers import check_tensor_parallel_config


def make_tp_mesh(tp: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """The 1-D 'tp' mesh this rank belongs to: all ranks (default), or, when tp < world size, its row of a
    (world_size / tp, tp) mesh named ('dp', 'tp') — consecutive ranks, as on a node. 'cuda' under nccl."""
    world_size = dist.get_world_size()
    tp = tp or world_size
    if world_size % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the world size {world_size}")
    device_type = device_type or ("cuda" if backend_uses_cuda(dist.get_backend()) else "cpu")
    if tp == world_size:
        return init_device_mesh(device_type, (tp,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def block_plan(fuse_region_input: bool = True, sequence_parallel: bool = False) -> dict:
    """The parallelize_module plan of one Block (keys are paths inside the block).

    fuse_region_input: make attn's and mlp's input a replicated DTensor once, so the three (two) column-parallel
    projections reading it share one backward all-reduce. sequence_parallel: the norms and the residual stream
    between regions are split along the sequence (Shard(1)); regions all-gather their input and reduce-scatter
    their output instead of all-reducing it.
    """
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=between),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    if fuse_region_input or sequence_parallel:
        plan["attn"] = PrepareModuleInput(input_layouts=(between, None, None),
                                          desired_input_layouts=(Replicate(), None, None))
        plan["mlp"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan["attn_norm"] = SequenceParallel()
        plan["mlp_norm"] = SequenceParallel()
    return plan


def apply_dtensor_tp(model: GPT, mesh: DeviceMesh, fuse_region_input: bool = True,
                     sequence_parallel: bool = False) -> GPT:
    """Parallelize every block of `model` in place over the 1-D `mesh`; embedding and lm_head stay replicated.

    With sequence_parallel the embedding output is cut along the sequence (each rank keeps its tokens, no
    communication) and the final norm's output is all-gathered before the replicated lm_head.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(model, GPT) and not isinstance(blocks, nn.ModuleDict):
        raise TypeError(f"apply_dtensor_tp expects a course_lib.core.model.GPT or a pipeline stage of one "
                        f"(course_lib.pipeline_parallel.stage.GPTStage), got {type(model).__name__}")
    if sequence_parallel and not isinstance(model, GPT):
        raise ValueError("sequence parallelism needs the whole GPT (its embedding and final norm), not a stage")
    if mesh.ndim != 1:
        raise ValueError(f"apply_dtensor_tp needs a 1-D tensor-parallel mesh, got {mesh.ndim} dimensions; "
                         "pass mesh['tp'] of a larger mesh")
    check_tensor_parallel_config(model.config, mesh.size())
    plan = block_plan(fuse_region_input, sequence_parallel)
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "tok_emb": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            "norm_f": SequenceParallel(),
            "lm_head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                          use_local_output=True),
        })
    return model


def full_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of the whole tensor; a DTensor is all-gathered first (a collective: every rank
    calls it, for the same tensors in the same order)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def gather_full_dtensor(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of a DTensor-parallel model at full size, keyed by the unsharded names."""
    full = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            raise RuntimeError(f"{name} has no gradient: call backward before gather_full_dtensor(..., grads=True)")
        full[name] = full_copy(tensor)
    return full


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives DTensor issues while active, 'forward' vs 'backward': calls, and bytes of the tensor
    each rank contributes (an all-reduce's or reduce-scatter's full input; an all-gather's input is 1/t of its
    result).

    DTensor lowers every redistribution to functional collectives (_c10d_functional.all_reduce, ...); this mode
    sees them after DTensor has run (returning NotImplemented for DTensor arguments lets DTensor go first, as
    torch's CommDebugMode does). Backward is recognised by a running autograd graph task.
    """

    COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()  # keys (phase, op)
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name.rstrip("_") in self.COLLECTIVES:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            tensor = args[0]
            self.calls[phase, name.rstrip("_")] += 1
            self.bytes[phase, name.rstrip("_")] += tensor.numel() * tensor.element_size()
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        """{'forward all_reduce': {'calls': n, 'bytes': m}, ...}"""
        return {f"{phase} {op}": {"calls": n, "bytes": self.bytes[phase, op]}
                for (phase, op), n in sorted(self.calls.items())}

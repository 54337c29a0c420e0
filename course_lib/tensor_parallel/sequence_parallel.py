"""Sequence parallelism (Megatron-SP; Korthikanti et al. 2022): the regions between tensor-parallel layers, split
along the sequence.

Tensor parallelism leaves the norms, the dropouts and the residual additions whole: every rank computes them on
the full (b, s, h) activation and keeps what they save for backward, t times over. Sequence parallelism gives rank
r positions [r s/t, (r+1) s/t) of those regions (norms and dropouts treat positions independently), and changes
the two operations at the edges of each tensor-parallel region:

    entrance (Megatron's g-bar): forward all-gather along the sequence,  backward reduce-scatter
    exit     (Megatron's g):     forward reduce-scatter along the sequence, backward all-gather

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes sent are those of tensor parallelism;
what the norm regions save for backward is divided by t. The norms' weights are replicated but each rank sees
only its positions: their gradients are summed over the ranks after backward (`allreduce_sequence_parallel_grads`).

    enter, leave = gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
    apply_sequence_parallel_block(block)       # this rank's shards, enter/leave placed; input (b, s/t, h)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.tensor_parallel.tp_layers import CommStats, ColumnParallelLinear, RowParallelLinear

SEQUENCE_DIM = 1  # of (batch, sequence, hidden)


def _record(stats: CommStats | None, phase: str, tensor: torch.Tensor) -> None:
    if stats is not None:
        stats.record(phase, tensor)


def _gather_single():  # torch 2.12's name; all_gather_into_tensor before (the GPU nodes' 2.11)
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s/t, h) on every rank -> (b, s, h): the ranks' positions in rank order (one all-gather)."""
    world_size = dist.get_world_size(group)
    local = x.movedim(SEQUENCE_DIM, 0).contiguous()  # the sequence first: the gather concatenates dimension 0
    out = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
    _gather_single()(out, local, group=group)
    return out.movedim(0, SEQUENCE_DIM)


def reduce_scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s, h) partial sums on every rank -> (b, s/t, h): this rank's positions of the sum (one reduce-scatter)."""
    world_size = dist.get_world_size(group)
    full = x.movedim(SEQUENCE_DIM, 0).contiguous()
    if full.shape[0] % world_size:
        raise ValueError(f"the sequence length {full.shape[0]} does not divide over {world_size} ranks")
    out = full.new_empty((full.shape[0] // world_size, *full.shape[1:]))
    _reduce_scatter_single()(out, full, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, SEQUENCE_DIM)


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Region entrance: forward all-gathers the sequence, backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        out = gather_sequence(x, group)
        _record(stats, "forward", out)
        return out

    @staticmethod
    def backward(ctx, grad):
        _record(ctx.stats, "backward", grad)
        return reduce_scatter_sequence(grad, ctx.group), None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Region exit: forward reduce-scatters the partial sums along the sequence, backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        _record(stats, "forward", x)
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        out = gather_sequence(grad, ctx.group)
        _record(ctx.stats, "backward", out)
        return out, None, None


def gather_from_sequence_parallel_region(x, group=None, stats: CommStats | None = None):
    return GatherFromSequenceParallelRegion.apply(x, group, stats)


def reduce_scatter_to_sequence_parallel_region(x, group=None, stats: CommStats | None = None):
    return ReduceScatterToSequenceParallelRegion.apply(x, group, stats)


def apply_sequence_parallel_block(block: nn.Module, group=None, enter=None, leave=None,
                                  stats: CommStats | None = None) -> nn.Module:
    """Shard a course GPT block in place for tensor + sequence parallelism over `group`: q/k/v, gate/up column-
    parallel; o_proj, down_proj row-parallel without their all-reduce; `enter` on the input of attention and of the
    MLP, `leave` on the output of o_proj and down_proj (default: course_lib's all-gather and reduce-scatter). The
    block then takes and returns this rank's positions, (b, s/t, h). `stats` counts the payload of each exchange
    (the gathered or scattered full tensor)."""
    enter = enter or (lambda x: gather_from_sequence_parallel_region(x, group, stats))
    leave = leave or (lambda y: reduce_scatter_to_sequence_parallel_region(y, group, stats))
    attn, mlp = block.attn, block.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, ColumnParallelLinear(getattr(attn, name), group))
    attn.o_proj = RowParallelLinear(attn.o_proj, group, reduce=False)
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, group, reduce=False)
    for region in (attn, mlp):
        region.register_forward_pre_hook(lambda module, args: (enter(args[0]), *args[1:]))
    for exit_layer in (attn.o_proj, mlp.down_proj):
        exit_layer.register_forward_hook(lambda module, args, output: leave(output))
    return block


def allreduce_sequence_parallel_grads(block: nn.Module, group=None) -> list[str]:
    """Sum over the ranks the gradients of the weights that every rank holds whole but applies to its positions
    only (the norms): returns their names."""
    names = []
    for name, param in block.named_parameters():
        if "norm" in name and param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            names.append(name)
    return names

"""Megatron-style tensor parallelism from scratch: split every weight matrix of a block over the ranks.

A linear layer y = x W^T can be split two ways over t ranks (W has shape (out, in)):

- **column-parallel**: rank r holds rows r of W's out dimension (W_r: (out/t, in)) and computes y_r = x W_r^T,
  a slice of y's last dimension. Its input x must be the same on every rank.
- **row-parallel**: rank r holds columns r of W's in dimension (W_r: (out, in/t)) and computes x_r W_r^T from
  its slice x_r of the input; the full y is the *sum* over ranks (an all-reduce).

Megatron-LM (Shoeybi et al. 2019) pairs them so that each half of a block needs one all-reduce forward and one
backward: attention = q/k/v column-parallel (rank r gets heads r*n_head/t ...), o row-parallel; SwiGLU MLP =
gate/up column-parallel, down row-parallel. Two conjugate operations mark the edges of a parallel region:

    f  (region entrance): forward identity,   backward all-reduce of the input gradient
    g  (region exit):     forward all-reduce, backward identity

Embedding, norms and the (tied) lm_head stay replicated: every rank holds and updates a full copy. Their
gradients come out identical on every rank without extra communication, because f's backward all-reduce hands
each rank the *full* gradient of the region input (see `apply_tensor_parallel`).

    from course_lib.runtime.launch import launch
    from course_lib.tensor_parallel.workers import scratch_tp_run
    launch(scratch_tp_run, world_size=2)              # parity with one process, communication counted

    python -m pytest -q tests/tensor_parallel/test_tp_layers.py
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.checks import positive_int, positive_ints
from course_lib.core.model import GPT, GPTConfig
from course_lib.data_parallel.ddp import broadcast_parameters

TP_ALLREDUCES_PER_LAYER = {"forward": 2, "backward": 2}  # g after attention and MLP; f before them


@dataclass
class CommStats:
    """Counts the all-reduces that f and g issue: calls and payload bytes, keyed 'forward' / 'backward'."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, phase: str, tensor: torch.Tensor) -> None:
        self.calls[phase] += 1
        self.bytes[phase] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def _all_reduce(tensor: torch.Tensor, group, stats: CommStats | None, phase: str) -> torch.Tensor:
    out = tensor.contiguous().clone()  # never modify a tensor autograd handed us
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        stats.record(phase, out)
    return out


class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the ranks (each rank saw part of it)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.stats, "backward"), None, None


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: forward sums the partial outputs over the ranks; backward identity (each rank needs the full grad)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        return _all_reduce(x, group, stats, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_parallel_region(x, group=None, stats: CommStats | None = None):
    return CopyToParallelRegion.apply(x, group, stats)


def reduce_from_parallel_region(x, group=None, stats: CommStats | None = None):
    return ReduceFromParallelRegion.apply(x, group, stats)


def _shard(tensor: torch.Tensor, dim: int, rank: int, world_size: int, what: str) -> torch.Tensor:
    if tensor.shape[dim] % world_size != 0:
        raise ValueError(f"{what}: dimension {dim} of size {tensor.shape[dim]} is not divisible by the "
                         f"tensor-parallel size {world_size}")
    return tensor.detach().chunk(world_size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """This rank's slice of `linear`'s outputs: weight rows [r*out/t, (r+1)*out/t). Output stays split.

    The input must be identical on every rank; f (applied once at the region entrance) makes its gradient
    the sum over ranks.
    """

    split_dim = 0  # of the weight (out, in): the dimension gathered to rebuild the full matrix

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features // world_size
        self.weight = nn.Parameter(_shard(linear.weight, 0, rank, world_size, "ColumnParallelLinear weight"))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(_shard(bias, 0, rank, world_size, "bias"))

    def forward(self, x):  # (..., in) -> (..., out / t)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local)"


class RowParallelLinear(nn.Module):
    """This rank's slice of `linear`'s inputs: weight columns [r*in/t, (r+1)*in/t); g sums the partial outputs."""

    split_dim = 1

    def __init__(self, linear: nn.Linear, group=None, stats: CommStats | None = None, reduce: bool = True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if not reduce and linear.bias is not None:
            raise ValueError("RowParallelLinear(reduce=False) returns a partial sum: add the bias after the reduction, "
                             "not on every rank")
        self.group, self.stats, self.reduce = group, stats, reduce
        self.in_features, self.out_features = linear.in_features // world_size, linear.out_features
        self.weight = nn.Parameter(_shard(linear.weight, 1, rank, world_size, "RowParallelLinear weight"))
        # The bias is added once, after the sum (adding it on every rank would count it t times).
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):  # (..., in / t) -> (..., out), the same on every rank (reduce=False: this rank's part)
        if not self.reduce:  # sequence parallelism reduce-scatters the partial sums after the layer
            return F.linear(x, self.weight)
        y = reduce_from_parallel_region(F.linear(x, self.weight), self.group, self.stats)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}"


def check_tensor_parallel_config(config: GPTConfig, tp_size: int) -> None:
    """Raise a clear error when the heads or the MLP width cannot be split evenly over tp_size ranks."""
    positive_int("tensor-parallel size", tp_size)
    if config.n_head % tp_size:
        raise ValueError(f"GPTConfig.n_head ({config.n_head}) is not divisible by the tensor-parallel size "
                         f"({tp_size}): attention is split by whole heads")
    if config.ffn_hidden % tp_size:
        raise ValueError(f"GPTConfig.ffn_hidden ({config.ffn_hidden}) is not divisible by the tensor-parallel "
                         f"size ({tp_size}): the MLP is split along its hidden width")


def _enter_region_hook(group, stats):
    """Forward pre-hook: f on the module's first input, once for all the column-parallel layers reading it."""
    def hook(module, args):
        return (copy_to_parallel_region(args[0], group, stats), *args[1:])
    return hook


def apply_tensor_parallel(model: GPT, group=None, broadcast: bool = True) -> GPT:
    """Shard every block of `model` in place over the ranks of `group`; returns `model`, whose `tp_stats` (a
    CommStats) counts the all-reduces f and g issue.

    Attention: q/k/v column-parallel and o row-parallel, so rank r runs heads [r*n_head/t, (r+1)*n_head/t).
    CausalSelfAttention reads its head count off the projection output (`view(B, T, -1, head_dim)`), so the
    same forward runs n_head/t heads; RoPE's cos/sin have shape (T, head_dim) and apply to each head alike.
    MLP: gate/up column-parallel, down row-parallel (silu(gate) * up is elementwise, so it stays local).
    f sits on the input of `attn` and `mlp` (a forward pre-hook: one all-reduce in backward for q, k and v
    together), g inside each row-parallel layer. Embedding, norms and the tied lm_head stay replicated.

    broadcast: first copy rank 0's weights to every rank, so the shards come from one unsharded model even
    if the ranks were seeded differently. Parity with one process needs dropout = 0 (dropout masks inside a
    shard would differ from the unsharded model's).
    """
    if not isinstance(model, GPT):
        raise TypeError(f"apply_tensor_parallel expects a course_lib.core.model.GPT, got {type(model).__name__}")
    if getattr(model, "tp_stats", None) is not None:
        raise RuntimeError("this model is already tensor-parallel (apply_tensor_parallel was called twice)")
    world_size = dist.get_world_size(group)
    check_tensor_parallel_config(model.config, world_size)
    if broadcast:
        broadcast_parameters(model, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    stats = CommStats()
    for block in model.blocks:
        apply_tensor_parallel_attention(block.attn, group, stats)
        mlp = block.mlp
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group, stats)
        mlp.register_forward_pre_hook(_enter_region_hook(group, stats))
    model.tp_stats = stats
    return model


def apply_tensor_parallel_attention(attn: nn.Module, group=None, stats: CommStats | None = None) -> nn.Module:
    """One attention module split in place over `group`: q/k/v column-parallel (this rank's heads), o row-parallel
    (g inside it), f on its input. The same forward then runs n_head/t heads."""
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, ColumnParallelLinear(getattr(attn, name), group))
    attn.o_proj = RowParallelLinear(attn.o_proj, group, stats)
    attn.n_local_heads = attn.q_proj.out_features // attn.head_dim  # for readers; the forward infers it
    attn.register_forward_pre_hook(_enter_region_hook(group, stats))
    return attn


def _parallel_layers(model: nn.Module):
    return {name: m for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def gather_full(model: nn.Module, group=None, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its .grad) at full size: shards all-gathered and concatenated; replicas as they are.

    Keys are the unsharded model's parameter names, so the result compares directly with it.
    Collective: every rank of `group` must call it.
    """
    world_size = dist.get_world_size(group)
    split_dims = {f"{name}.weight": layer.split_dim for name, layer in _parallel_layers(model).items()}
    split_dims.update({f"{name}.bias": 0 for name, layer in _parallel_layers(model).items()
                       if isinstance(layer, ColumnParallelLinear) and layer.bias is not None})
    full = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            raise RuntimeError(f"{name} has no gradient: call backward before gather_full(..., grads=True)")
        if name in split_dims:
            pieces = [torch.empty_like(tensor) for _ in range(world_size)]
            dist.all_gather(pieces, tensor.contiguous(), group=group)
            tensor = torch.cat(pieces, dim=split_dims[name])
        full[name] = tensor.clone()
    return full


def replicated_parameter_names(model: nn.Module) -> list[str]:
    """Parameters every rank holds in full (embedding, norms, lm_head): not inside a parallel layer."""
    sharded = {f"{name}.{p}" for name, layer in _parallel_layers(model).items() for p, _ in layer.named_parameters()}
    return [name for name, _ in model.named_parameters() if name not in sharded]


def tp_allreduce_bytes_per_layer(batch: int, seq_len: int, n_embd: int, element_size: int = 4) -> int:
    """Payload all-reduced per transformer layer per training step: 2 forward (g) + 2 backward (f) of b*s*h.

    Each ring all-reduce of S bytes moves 2 (t-1)/t * S bytes in and out of every rank.
    """
    positive_ints(batch=batch, seq_len=seq_len, n_embd=n_embd, element_size=element_size)
    return sum(TP_ALLREDUCES_PER_LAYER.values()) * batch * seq_len * n_embd * element_size

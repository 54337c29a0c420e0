"""Four dimensions on eight ranks: data, context and tensor parallelism, and expert parallelism over the data and
context ranks, in one transformer block whose MLP is a mixture of experts. The result equals one process.

The ranks form a (dp, cp, tp) grid, tensor parallel fastest (one node's GPUs): rank = (d * cp + c) * tp + t.

- tensor group (same d, c): the heads of attention are split over it (Megatron: q/k/v column-parallel, o
  row-parallel, f at the entrance, g inside o_proj);
- context group (same d, t): the sequence is split over it (zigzag), and attention is ring attention;
- expert group (same t: every (d, c)): the experts are split over its dp * cp ranks, and each rank's tokens
  travel to their experts and back by two all-to-alls. Expert parallelism shares its ranks with data and
  context parallelism, as Megatron-LM and DeepSpeed-MoE lay it out;
- data: rank (d, c, t) holds rows d of the batch. The weights every rank holds whole (norms, router) or per tensor
  rank (attention's shards) get their gradients summed over the expert group, the dp * cp ranks that saw parts
  of the batch; each expert's gradient is complete where it lives.

    ranks = launch(four_d_run, 8, kwargs=dict(dp=2, cp=2, tp=2))
    reference = four_d_reference(dp=2, cp=2)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.context_parallel.ring import RingStats, positions, ring_attention
from course_lib.core.model import CausalSelfAttention, GPTConfig, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb
from course_lib.expert_parallel.moe import ExpertParallelMoE, MoE
from course_lib.tensor_parallel.tp_layers import (
    ColumnParallelLinear,
    CommStats,
    RowParallelLinear,
    copy_to_parallel_region,
)

FOUR_D_SHAPE = {"batch": 4, "seq_len": 16, "n_embd": 32, "n_head": 4, "n_experts": 4, "hidden": 64, "top_k": 2,
         "capacity_factor": 2.0}
AUX_WEIGHT = 0.01
DIMS = ("dp", "cp", "tp")


class MoEBlock(nn.Module):
    """Pre-norm transformer block with a mixture-of-experts MLP: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, n_embd: int, n_head: int, n_experts: int, hidden: int, top_k: int, capacity_factor: float,
                 block_size: int):
        super().__init__()
        config = GPTConfig(n_layer=1, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=0.0)
        self.attn_norm = RMSNorm(n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(n_embd, config.norm_eps)
        self.moe = MoE(n_embd, hidden, n_experts, top_k, capacity_factor)
        self.rope = RotaryEmbedding(config.head_dim, block_size)


def four_d_inputs(seed: int = 0, **shape):
    """The block (seeded), the input (batch, seq_len, n_embd) and an upstream gradient, the same everywhere."""
    s = {**FOUR_D_SHAPE, **shape}
    torch.manual_seed(seed)
    block = MoEBlock(s["n_embd"], s["n_head"], s["n_experts"], s["hidden"], s["top_k"], s["capacity_factor"],
                     s["seq_len"])
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s["batch"], s["seq_len"], s["n_embd"], generator=generator)
    return block, x, torch.randn(x.shape, generator=generator)


def four_d_place(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """(d, c, t) of a rank in the (dp, cp, tp) grid, tp fastest."""
    t = rank % sizes["tp"]
    c = rank // sizes["tp"] % sizes["cp"]
    return {"dp": rank // (sizes["tp"] * sizes["cp"]), "cp": c, "tp": t}


def four_d_groups(sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of ranks: tp, cp, dp and ep (the dp x cp ranks of one tensor rank)."""
    world = sizes["dp"] * sizes["cp"] * sizes["tp"]
    places = [four_d_place(r, sizes) for r in range(world)]

    def grouped(vary: tuple[str, ...]) -> list[list[int]]:
        keys = {}
        for rank, place in enumerate(places):
            keys.setdefault(tuple(place[d] for d in DIMS if d not in vary), []).append(rank)
        return list(keys.values())

    return {"tp": grouped(("tp",)), "cp": grouped(("cp",)), "dp": grouped(("dp",)), "ep": grouped(("dp", "cp"))}


def _token_slices(sizes: dict[str, int], d: int, c: int, batch: int, seq_len: int, layout: str):
    rows = torch.arange(d * batch // sizes["dp"], (d + 1) * batch // sizes["dp"])
    return rows, positions(c, sizes["cp"], seq_len // sizes["cp"], layout)


def four_d_reference(dp: int = 2, cp: int = 2, layout: str = "zigzag", seed: int = 0, **shape) -> dict:
    """One process, the whole block, batch and sequence; the experts route each (data, context) rank's tokens as
    one group, as the expert-parallel ranks do. Output, input gradient and every parameter's gradient."""
    s = {**FOUR_D_SHAPE, **shape}
    block, x, upstream = four_d_inputs(seed, **shape)
    x.requires_grad_()
    sizes = {"dp": dp, "cp": cp, "tp": 1}
    cos, sin = block.rope(s["seq_len"])
    h = x + block.attn(block.attn_norm(x), cos, sin)
    tokens = block.mlp_norm(h)
    slices = [_token_slices(sizes, d, c, s["batch"], s["seq_len"], layout) for d in range(dp) for c in range(cp)]
    groups = [tokens[rows][:, pos].reshape(-1, s["n_embd"]) for rows, pos in slices]
    out, aux = block.moe(torch.cat(groups), groups=len(groups))
    moe_out = torch.zeros_like(h)
    for (rows, pos), part in zip(slices, out.chunk(len(groups))):
        moe_out = moe_out.index_put((rows[:, None], pos[None, :]), part.view(len(rows), len(pos), -1))
    y = h + moe_out
    ((y * upstream).sum() + AUX_WEIGHT * aux).backward()
    return {"y": y.detach(), "x_grad": x.grad, "aux": aux.item(),
            "grads": {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}}


def four_d_run(dp: int = 2, cp: int = 2, tp: int = 2, layout: str = "zigzag", seed: int = 0, **shape) -> dict:
    """Worker: this rank's part of the block, batch and sequence under dp x cp x tp (+ experts over dp x cp);
    forward, backward, and the gradients summed where they must be. Returns this rank's place, output and input
    gradient rows and positions, its parameters' gradients under the full block's names (with how each is split),
    and the bytes each dimension sent."""
    s = {**FOUR_D_SHAPE, **shape}
    sizes = {"dp": dp, "cp": cp, "tp": tp}
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != dp * cp * tp:
        raise ValueError(f"dp * cp * tp = {dp} * {cp} * {tp} = {dp * cp * tp} ranks, but the job has {world_size}")
    place = four_d_place(rank, sizes)
    mine = {}
    for kind, groups in four_d_groups(sizes).items():  # every rank creates every group, in the same order
        for members in groups:
            group = dist.new_group(members)
            if rank in members:
                mine[kind] = group
    block, x, upstream = four_d_inputs(seed, **shape)
    rows, pos = _token_slices(sizes, place["dp"], place["cp"], s["batch"], s["seq_len"], layout)
    x_local = x[rows][:, pos].clone().requires_grad_()
    attn, tp_stats, ring_stats = block.attn, CommStats(), RingStats()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, ColumnParallelLinear(getattr(attn, name), mine["tp"]))
    attn.o_proj = RowParallelLinear(attn.o_proj, mine["tp"], tp_stats)
    moe = ExpertParallelMoE(block.moe, group=mine["ep"])
    cos, sin = block.rope(s["seq_len"])

    normed = copy_to_parallel_region(block.attn_norm(x_local), mine["tp"], tp_stats)  # f
    B, T, _ = normed.shape
    q, k, v = (proj(normed).view(B, T, -1, attn.head_dim).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = apply_rotary_pos_emb(q, k, cos[pos], sin[pos])  # the rotation of each position this rank holds
    attended = ring_attention(q, k, v, layout=layout, group=mine["cp"], stats=ring_stats)
    h = x_local + attn.o_proj(attended.transpose(1, 2).reshape(B, T, -1))  # g inside o_proj
    out, aux = moe(block.mlp_norm(h).reshape(-1, s["n_embd"]))
    y = h + out.view_as(h)
    ((y * upstream[rows][:, pos]).sum() + AUX_WEIGHT * aux / (dp * cp)).backward()

    sync_bytes = 0
    grads = {}
    for name, param in block.named_parameters():
        if param.grad is None:
            continue
        if not name.startswith("moe.experts."):  # seen by every (data, context) rank: sum their parts
            dist.all_reduce(param.grad, group=mine["ep"])
            sync_bytes += param.grad.numel() * param.grad.element_size()
        grads[name] = param.grad.clone()
    first_expert = dist.get_rank(mine["ep"]) * moe.local  # block.moe keeps every expert; this rank's have grads
    return {"rank": rank, "place": place, "rows": rows.tolist(), "positions": pos.tolist(), "y": y.detach(),
            "x_grad": x_local.grad, "grads": grads, "aux": aux.item(),
            "bytes": {"tp": tp_stats.total_bytes, "cp": sum(ring_stats.sent_elements.values()) * 4,
                      "ep": 4 * moe.stats["elements_sent_per_all_to_all"] * 4, "sync": sync_bytes},
            "experts": list(range(first_expert, first_expert + moe.local))}

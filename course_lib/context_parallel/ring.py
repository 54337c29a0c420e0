"""Context parallelism: causal attention over a sequence split across ranks, by ring attention.

Each of the N ranks of `group` holds a contiguous chunk of the sequence: its queries, keys and values, shape
(batch, heads, T / N, head_dim). It keeps its queries and passes the key/value block it holds to the next rank
around a ring, N - 1 times, so every query meets every key once. Each step computes one block of attention,
its output and the log-sum-exp of its scores per query, and merges it into the running result with the online
softmax (Milakov & Gimelshein 2018; the form of FlashAttention and of Liu et al. 2023, "Ring Attention with
Blockwise Transformers"):

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward passes the key/value blocks around the ring again, with their gradients travelling alongside, so that
each block returns to its owner carrying dK and dV summed over every rank's queries. Nothing of size T x T is
ever kept: each rank holds its queries, one block in flight and the per-query log-sum-exp.

Causal masking: the block of rank s seen by the queries of rank r is whole (s < r), lower-triangular (s == r)
or entirely masked and skipped (s > r). Rank N - 1 computes N blocks, rank 0 one: with a contiguous split the
work is unbalanced. `zigzag_split` gives each rank two chunks of 2N, chunk r and chunk 2N - 1 - r, which evens
it out (every rank computes the same number of query-key pairs).

    from course_lib.context_parallel import ring_attention, zigzag_split, zigzag_merge
    out = ring_attention(q_local, k_local, v_local)                   # contiguous chunks, autograd works
    out = ring_attention(q_zz, k_zz, v_zz, layout="zigzag")            # two chunks per rank
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal attention of queries at positions q_pos over keys at k_pos: (output, log-sum-exp per query).

    Returns None when no query sees any key (the whole block is masked). A query that sees none of these keys
    gets lse = -inf and a zero output, which the merge weighs by exp(-inf) = 0.
    """
    allowed = q_pos[:, None] >= k_pos[None, :]
    if not bool(allowed.any()):
        return None
    scores = (q @ k.transpose(-2, -1)).float() * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return (probs.to(v.dtype) @ v).float(), lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The online softmax: the attention over the union of two key sets from the attention over each."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    out = out * torch.exp(lse - finite)[..., None] + block_out * torch.exp(block_lse - finite)[..., None]
    return out, new_lse


def positions(rank: int, world_size: int, local_len: int, layout: str) -> torch.Tensor:
    """The sequence positions of the rows a rank holds: one contiguous chunk, or zigzag's chunks r and 2N-1-r."""
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len)
    if layout == "zigzag":
        if local_len % 2:
            raise ValueError(f"zigzag needs an even number of rows per rank, got {local_len}")
        half = local_len // 2
        return torch.cat([torch.arange(rank * half, (rank + 1) * half),
                          torch.arange((2 * world_size - 1 - rank) * half, (2 * world_size - rank) * half)])
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def zigzag_split(x: torch.Tensor, rank: int, world_size: int, dim: int = -2) -> torch.Tensor:
    """This rank's rows of a full sequence under zigzag: chunks r and 2N - 1 - r of 2N equal chunks."""
    chunks = x.chunk(2 * world_size, dim=dim)
    if len(chunks) != 2 * world_size or x.shape[dim] % (2 * world_size):
        raise ValueError(f"zigzag splits the sequence into 2N = {2 * world_size} equal chunks; length {x.shape[dim]}")
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def contiguous_split(x: torch.Tensor, rank: int, world_size: int, dim: int = -2) -> torch.Tensor:
    if x.shape[dim] % world_size:
        raise ValueError(f"the sequence length {x.shape[dim]} does not divide by {world_size} ranks")
    return x.chunk(world_size, dim=dim)[rank]


def split_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = -2):
    return (zigzag_split if layout == "zigzag" else contiguous_split)(x, rank, world_size, dim)


def unsplit_sequence(pieces: list[torch.Tensor], layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's rows (rank order), the inverse of split_sequence."""
    if layout == "contiguous":
        return torch.cat(pieces, dim=dim)
    n = len(pieces)
    halves = [piece.chunk(2, dim=dim) for piece in pieces]
    return torch.cat([halves[r][0] for r in range(n)] + [halves[r][1] for r in reversed(range(n))], dim=dim)


class RingStats:
    """What one rank did in its last ring attention: elements sent, block products computed (query-key pairs
    that were not masked, and blocks), per pass."""

    def __init__(self):
        self.sent_elements = {"forward": 0, "backward": 0}
        self.pairs = {"forward": 0, "backward": 0}
        self.blocks = {"forward": 0, "backward": 0}


def start_ring_pass(tensors: list[torch.Tensor], group=None):
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's (batch_isend_irecv).
    Returns (works, received): wait for every work before reading `received`."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def finish_ring_pass(works, received) -> list[torch.Tensor]:
    for work in works:
        work.wait()
    return received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, layout, group, stats):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_pos = positions(rank, world_size, q.shape[-2], layout)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block_k, block_v = k, v
        for step in range(world_size):
            source = (rank - step) % world_size  # whose keys and values this rank holds now
            k_pos = positions(source, world_size, k.shape[-2], layout)
            if step < world_size - 1:  # pass the block on while this rank computes with it
                passing = start_ring_pass([block_k, block_v], group)
                if stats is not None:
                    stats.sent_elements["forward"] += block_k.numel() + block_v.numel()
            result = block_attention(q, block_k, block_v, q_pos, k_pos, scale)
            if result is not None:
                out, lse = merge(out, lse, *result)
                if stats is not None:
                    stats.blocks["forward"] += 1
                    stats.pairs["forward"] += int((q_pos[:, None] >= k_pos[None, :]).sum())
            if step < world_size - 1:
                block_k, block_v = finish_ring_pass(*passing)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.layout, ctx.group, ctx.stats = scale, layout, group, stats
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, layout, group, stats = ctx.scale, ctx.layout, ctx.group, ctx.stats
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_pos = positions(rank, world_size, q.shape[-2], layout)
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)  # D_i = sum_j P_ij dP_ij = dO_i . O_i
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block_k, block_v = k, v
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        safe_lse = lse.masked_fill(torch.isinf(lse), 0.0)
        for step in range(world_size):
            source = (rank - step) % world_size
            k_pos = positions(source, world_size, k.shape[-2], layout)
            allowed = q_pos[:, None] >= k_pos[None, :]
            if bool(allowed.any()):
                scores = (q @ block_k.transpose(-2, -1)).float() * scale
                probs = torch.exp(scores - safe_lse[..., None]).masked_fill(~allowed, 0.0)
                dv += probs.transpose(-2, -1) @ grad_out
                dprobs = grad_out @ block_v.float().transpose(-2, -1)
                dscores = probs * (dprobs - delta[..., None])
                dq += dscores @ block_k.float() * scale
                dk += dscores.transpose(-2, -1) @ q.float() * scale
                if stats is not None:
                    stats.blocks["backward"] += 1
                    stats.pairs["backward"] += int(allowed.sum())
            # the block moves on with its gradients; after N passes the gradients are home, summed over all queries
            if world_size > 1:
                moving = [block_k, block_v, dk, dv] if step < world_size - 1 else [dk, dv]
                if stats is not None:
                    stats.sent_elements["backward"] += sum(t.numel() for t in moving)
                moved = finish_ring_pass(*start_ring_pass(moving, group))
                if step < world_size - 1:
                    block_k, block_v, dk, dv = moved
                else:
                    dk, dv = moved
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "contiguous", group=None,
                   stats: RingStats | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence, from this rank's rows of q, k, v (batch, heads, T/N, head_dim).

    layout: how the sequence was split over the ranks ("contiguous": rank r holds rows [rT/N, (r+1)T/N);
    "zigzag": zigzag_split). Differentiable: backward passes the blocks and their gradients around the ring.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have one shape (batch, heads, T/N, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, scale, layout, group, stats)

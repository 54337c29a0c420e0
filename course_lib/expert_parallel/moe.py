"""Mixture of experts: a top-k router, expert capacity, token dropping, the load-balancing loss, and expert
parallelism with two all-to-alls.

A MoE layer replaces a transformer block's MLP by E expert MLPs and a router. For each token the router's
softmax over the experts picks the top k; the token goes to those experts and comes back as the sum of their
outputs weighted by the router's (renormalised) probabilities (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch Transformer, Fedus et al. 2021, with k = 1).

Capacity. Every expert takes at most C = ceil(capacity_factor * tokens * k / E) tokens of a group (the tokens
one rank holds): fixed-size buffers, which accelerators and all-to-alls need. Assignments beyond C are
*dropped*, first come first served in token order (each token's first choice before anyone's second): a
dropped assignment contributes nothing, and the residual connection around the layer carries the token on.

Load balance. The Switch auxiliary loss, E * sum_e f_e * P_e, with f_e the fraction of the group's
assignments routed to expert e and P_e the mean router probability of e, is 1 when the load is uniform and
grows when the router favours a few experts; it is added to the training loss with a small weight.

Expert parallelism. With N ranks, rank r holds experts [r E/N, (r+1) E/N) and its own tokens. Each rank fills
a dispatch buffer (E, C, d), one slot per (expert, place in the queue), zeros where no token came; one
all_to_all sends the rows of expert e to e's rank, which receives (N, E/N, C, d), runs its experts, and a
second all_to_all returns the outputs to the ranks the tokens came from. Both are all_to_all_single over equal
splits, each rank sending (N-1)/N of its buffer; autograd's backward is the same exchange reversed.

    from course_lib.expert_parallel import MoE, ExpertParallelMoE
    moe = MoE(d_model=16, hidden=32, n_experts=4, top_k=2, capacity_factor=1.25)      # every expert here
    out, aux = moe(x, groups=2)          # x: (tokens, d_model); capacity per group of tokens/2 tokens
    ep = ExpertParallelMoE(moe)          # on every rank of a 2-rank job: this rank's experts, the router
    out, aux = ep(x_local)               # x_local: this rank's tokens; equal to moe's rows of this group
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    """One expert: the MLP of a block, Linear, GELU, Linear."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * tokens * top_k / n_experts): the slots of each expert for one group."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def route(logits: torch.Tensor, top_k: int, capacity_per_expert: int):
    """The routing of one group of tokens, from the router's logits (tokens, E).

    Returns (experts, weights, slots, probs): the chosen experts and their renormalised probabilities, both
    (tokens, k); the slot each assignment takes in its expert's queue, or -1 when the expert is full (dropped);
    and the softmax over all experts (tokens, E), for the auxiliary loss. Slots are handed out in order of
    choice (every token's first choice, then the second ones), and within a choice in token order.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    weights = top_probs / top_probs.sum(-1, keepdim=True)
    n_experts = logits.shape[-1]
    order = experts.t().reshape(-1)  # choice-major: choice 0 of every token, then choice 1, ...
    one_hot = F.one_hot(order, n_experts)
    position = (one_hot.cumsum(0) - 1).gather(1, order[:, None]).squeeze(1)  # place in the expert's queue
    slots = torch.where(position < capacity_per_expert, position, torch.full_like(position, -1))
    return experts, weights.to(logits.dtype), slots.view(top_k, -1).t(), probs


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss E * sum_e f_e P_e over the group's assignments (before dropping)."""
    n_experts = probs.shape[-1]
    f = F.one_hot(experts.reshape(-1), n_experts).float().mean(0)
    return n_experts * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """A MoE layer with every expert in this process. forward(x, groups) -> (output, aux loss): x (tokens, d)
    is cut into `groups` equal groups, each routed with its own capacity (as each rank of an expert-parallel job
    routes its own tokens); the aux loss is the mean of the groups'."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int = 2, capacity_factor: float = 1.25):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be between 1 and n_experts={n_experts}, got {top_k}")
        self.d_model, self.n_experts, self.top_k, self.capacity_factor = d_model, n_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, hidden) for _ in range(n_experts))

    def forward(self, x: torch.Tensor, groups: int = 1):
        if x.dim() != 2 or x.shape[1] != self.d_model or x.shape[0] % groups:
            raise ValueError(f"x must be (tokens, {self.d_model}) with tokens divisible by groups={groups}; "
                             f"got {tuple(x.shape)}")
        outputs, aux = [], []
        for part in x.chunk(groups):
            c = capacity(part.shape[0], self.n_experts, self.top_k, self.capacity_factor)
            experts, weights, slots, probs = route(self.router(part), self.top_k, c)
            out = torch.zeros_like(part)
            for e, expert in enumerate(self.experts):
                token, choice = torch.nonzero((experts == e) & (slots >= 0), as_tuple=True)
                if token.numel():
                    out = out.index_add(0, token, expert(part[token]) * weights[token, choice, None])
            outputs.append(out)
            aux.append(load_balancing_loss(probs, experts))
        return torch.cat(outputs), torch.stack(aux).mean()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over equal splits of dim 0; its gradient is the same exchange (it is its own inverse's
    transpose: what rank r sent to rank s comes back from s to r)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    return _AllToAll.apply(x, group)


class ExpertParallelMoE(nn.Module):
    """This rank's part of `moe` in an expert-parallel job over `group`: the router (replicated: its gradient
    must be averaged over the ranks like any data-parallel weight) and experts [r E/N, (r+1) E/N).

    forward(x) takes this rank's tokens and returns (output, aux loss) for them. `stats` after each forward:
    tokens (assignments) kept and dropped, the assignments sent to other ranks, and the elements each
    all-to-all sends to other ranks.
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % self.world_size:
            raise ValueError(f"{moe.n_experts} experts do not divide over {self.world_size} ranks")
        self.local = moe.n_experts // self.world_size
        self.n_experts, self.top_k, self.capacity_factor = moe.n_experts, moe.top_k, moe.capacity_factor
        self.router = moe.router
        first = self.rank * self.local
        self.experts = nn.ModuleList(moe.experts[first:first + self.local])
        self.stats: dict[str, int] = {}

    def forward(self, x: torch.Tensor):
        tokens, d = x.shape
        c = capacity(tokens, self.n_experts, self.top_k, self.capacity_factor)
        experts, weights, slots, probs = route(self.router(x), self.top_k, c)
        kept = slots >= 0
        token, choice = torch.nonzero(kept, as_tuple=True)
        flat_slot = experts[token, choice] * c + slots[token, choice]  # row of the (E * C, d) dispatch buffer
        dispatch = x.new_zeros(self.n_experts * c, d).index_copy(0, flat_slot, x[token])
        received = all_to_all(dispatch, self.group)  # (N * E_local * C, d): rank s's rows for my experts
        received = received.view(self.world_size, self.local, c, d)
        outputs = torch.stack([expert(received[:, e]) for e, expert in enumerate(self.experts)], dim=1)
        returned = all_to_all(outputs.reshape(-1, d), self.group)  # (E * C, d): my tokens' rows, expert-major
        out = x.new_zeros(tokens, d).index_add(0, token, returned[flat_slot] * weights[token, choice, None])
        owner = experts // self.local
        self.stats = {"assignments": experts.numel(), "kept": int(kept.sum()), "dropped": int((~kept).sum()),
                      "sent_to_other_ranks": int((kept & (owner != self.rank)).sum()),
                      "elements_sent_per_all_to_all": dispatch.numel() * (self.world_size - 1) // self.world_size,
                      "capacity": c}
        return out, load_balancing_loss(probs, experts)

"""Rank workers for expert parallelism: the experts spread over the ranks against one process holding them all.

    from course_lib import launch
    from course_lib.expert_parallel import moe_reference, moe_run
    ranks = launch(moe_run, 2)                        # one dict per rank
    reference = moe_reference(world_size=2)           # one process, every expert, the tokens in 2 groups

Every rank builds the same MoE and the same tokens from the seed, keeps its experts and its group of tokens,
and runs forward and backward of sum(output * g) + AUX_WEIGHT * aux / N (so that the ranks' losses add up to
one process's). It returns its rows of the output, the input's gradient, its experts' gradients, the router's
gradient summed over the ranks (a data-parallel weight) and what it sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.expert_parallel.moe import ExpertParallelMoE, MoE

MOE_SHAPE = {"d_model": 16, "hidden": 32, "n_experts": 4, "top_k": 2, "capacity_factor": 1.0}
AUX_WEIGHT = 0.01


def moe_inputs(world_size: int, tokens_per_rank: int = 24, seed: int = 0, **shape):
    """The MoE (seeded), the tokens of every rank (world_size * tokens_per_rank, d) and an upstream gradient."""
    shape = {**MOE_SHAPE, **shape}
    torch.manual_seed(seed)
    moe = MoE(**shape)
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(world_size * tokens_per_rank, shape["d_model"], generator=generator)
    return moe, x, torch.randn(x.shape, generator=generator)


def moe_reference(world_size: int, **kwargs) -> dict:
    """One process, every expert, the tokens in world_size groups: output, aux loss and gradients."""
    moe, x, g = moe_inputs(world_size, **kwargs)
    x.requires_grad_()
    out, aux = moe(x, groups=world_size)
    ((out * g).sum() + AUX_WEIGHT * aux).backward()
    return {"out": out.detach(), "aux": aux.item(), "x_grad": x.grad,
            "grads": {name: p.grad.clone() for name, p in moe.named_parameters()}}


def moe_run(**kwargs) -> dict:
    """Worker: this rank's experts and tokens through ExpertParallelMoE, forward and backward."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    moe, x, g = moe_inputs(world_size, **kwargs)
    rows = slice(rank * (x.shape[0] // world_size), (rank + 1) * (x.shape[0] // world_size))
    ep = ExpertParallelMoE(moe)
    x_local = x[rows].clone().requires_grad_()
    out, aux = ep(x_local)
    ((out * g[rows]).sum() + AUX_WEIGHT * aux / world_size).backward()
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    first = rank * ep.local
    grads = {f"experts.{first + e}.{name}": p.grad.clone() for e, expert in enumerate(ep.experts)
             for name, p in expert.named_parameters()}
    aux_all = torch.tensor([aux.item()], device=x_local.device)
    dist.all_reduce(aux_all)
    return {"rank": rank, "world_size": world_size, "out": out.detach(), "x_grad": x_local.grad, "grads": grads,
            "router_grad": router_grad, "aux_mean": aux_all.item() / world_size, "stats": dict(ep.stats)}

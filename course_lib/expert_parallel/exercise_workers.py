"""Rank workers that grade the expert-parallel exercise (Session F, notebook 02b): the learner's MoE layer with
its experts spread over the ranks, against one process holding every expert.

    ranks = launch(check_expert_parallel, 2, args=(spawnable(expert_parallel_moe),))
    reference = moe_reference(world_size=2)

Every rank builds the same MoE and tokens from the seed (moe_inputs), keeps its experts and its rows of the
tokens, and calls `expert_parallel_moe(x, router, experts, n_experts, top_k, capacity_factor, route)`, with
course_lib's `route` (so that a mistake in the routing exercise costs only that exercise). The worker then runs
backward of sum(output * g) + AUX_WEIGHT * aux / N, sums the router's gradient over the ranks (it is replicated,
a data-parallel weight) and records every collective the answer called: its name, its elements, its splits, and
whether it ran in forward or in backward.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn

from course_lib.expert_parallel.moe import capacity, route
from course_lib.expert_parallel.workers import AUX_WEIGHT, moe_inputs

RECORDED = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
            "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv", "isend", "irecv")


def route_reference(logits: torch.Tensor, top_k: int, capacity_per_expert: int):
    """course_lib's router (moe.route), as the routing exercise's tests call it."""
    return route(logits, top_k, capacity_per_expert)


def routing_of(x: torch.Tensor, router: nn.Module, n_experts: int, top_k: int, capacity_factor: float) -> dict:
    """What routing this rank's tokens does, recomputed: the capacity, the assignments kept and dropped, and the
    kept assignments whose expert lives on another rank (per destination rank)."""
    with torch.no_grad():
        c = capacity(x.shape[0], n_experts, top_k, capacity_factor)
        experts, _, slots, _ = route(router(x), top_k, c)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    owner = experts // (n_experts // world_size)
    kept = slots >= 0
    return {"capacity": c, "kept": int(kept.sum()), "dropped": int((~kept).sum()),
            "to_rank": [int((kept & (owner == r)).sum()) for r in range(world_size)], "rank": rank}


def check_expert_parallel(expert_parallel_moe, *, tokens_per_rank: int = 24, seed: int = 0, **shape) -> dict:
    """Worker: this rank's rows of the output and the input's gradient, its experts' gradients, the router's
    gradient summed over the ranks, the aux loss averaged over the ranks, the collectives the answer called and
    what its routing sends (routing_of)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    moe, x, g = moe_inputs(world_size, tokens_per_rank=tokens_per_rank, seed=seed, **shape)
    if moe.n_experts % world_size:
        raise ValueError(f"{moe.n_experts} experts do not divide over {world_size} ranks")
    local = moe.n_experts // world_size
    first = rank * local
    experts = nn.ModuleList(moe.experts[first:first + local])
    rows = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    x_local = x[rows].clone().requires_grad_()
    calls, phase = [], ["forward"]

    def recording(name, original):
        def call(tensor, *args, **kwargs):
            record = {"name": name, "phase": phase[0], "numel": getattr(tensor, "numel", lambda: 0)()}
            if name == "all_to_all_single":
                splits = kwargs.get("output_split_sizes", args[1] if len(args) > 1 else None)
                record["splits"] = None if splits is None else list(splits)
                record["numel"] = args[0].numel() if args else kwargs["input"].numel()
            calls.append(record)
            return original(tensor, *args, **kwargs)
        return call

    patches = {}
    for name in RECORDED:
        if hasattr(dist, name):
            patches[name] = recording(name, getattr(c10d, name))
    with mock.patch.multiple(dist, **patches), mock.patch.multiple(c10d, **patches):
        result = expert_parallel_moe(x_local, moe.router, experts, moe.n_experts, moe.top_k, moe.capacity_factor,
                                     route)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"expert_parallel_moe must return (output, aux_loss), got {type(result).__name__}")
        out, aux = result
        if not isinstance(out, torch.Tensor) or out.shape != x_local.shape:
            raise TypeError(f"the output must have the shape of this rank's tokens {tuple(x_local.shape)}, got "
                            f"{tuple(getattr(out, 'shape', ()))}")
        if not isinstance(aux, torch.Tensor) or aux.numel() != 1:
            raise TypeError(f"the aux loss must be a one-element tensor, got {aux!r}")
        phase[0] = "backward"
        ((out * g[rows]).sum() + AUX_WEIGHT * aux.reshape(()) / world_size).backward()
    router_grad = moe.router.weight.grad.clone() if moe.router.weight.grad is not None else torch.zeros_like(
        moe.router.weight)
    dist.all_reduce(router_grad)
    aux_all = torch.tensor([float(aux.detach())], device=x_local.device)
    dist.all_reduce(aux_all)
    grads = {f"experts.{first + e}.{name}": (p.grad.clone() if p.grad is not None else None)
             for e, expert in enumerate(experts) for name, p in expert.named_parameters()}
    return {"rank": rank, "world_size": world_size, "out": out.detach(), "x_grad": x_local.grad, "grads": grads,
            "router_grad": router_grad, "aux_mean": aux_all.item() / world_size, "calls": calls,
            "routing": routing_of(x_local.detach(), moe.router, moe.n_experts, moe.top_k, moe.capacity_factor),
            "d_model": x.shape[1], "n_experts": moe.n_experts}

"""Rank workers of `make bench`'s context and experts sections: one long sequence through ring attention, and a
batch of tokens through an expert-parallel MoE layer, timed step by step with the bytes each rank sends counted.

    from course_lib.runtime.launch import launch
    from course_tools.bench.cp_ep_workers import context_bench, experts_bench
    ranks = launch(context_bench, 2, kwargs=dict(seq_len=256, steps=3), threads_per_rank=1)
    ranks = launch(experts_bench, 2, kwargs=dict(tokens=256, steps=3), threads_per_rank=1)

The global work is the same at every world size (one sequence of seq_len positions; `tokens` tokens in all), so
the step times of 1, 2 and 4 ranks compare directly. A step runs from a barrier to the slowest rank's end.
"""

from __future__ import annotations

import time
from unittest import mock

import torch
import torch.distributed as dist

from course_lib.context_parallel.ring import RingStats, ring_attention, split_sequence
from course_lib.context_parallel.workers import attention_inputs
from course_lib.expert_parallel.moe import ExpertParallelMoE, MoE
from course_lib.runtime.env import get_dist_info

CONTEXT_LAYOUTS = ("contiguous", "zigzag")


def _slowest(seconds: float) -> float:
    """The step time of the slowest rank (every rank returns the same)."""
    t = torch.tensor([seconds], device=get_dist_info().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def context_bench(*, seq_len: int = 2048, batch: int = 1, heads: int = 4, head_dim: int = 32, warmup: int = 1,
                  steps: int = 5, layouts=CONTEXT_LAYOUTS, seed: int = 0) -> dict:
    """Ring attention forward and backward over one sequence split across the ranks, for each layout in turn:
    step time samples, elements sent (forward, backward), query-key pairs computed per rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs = attention_inputs(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, seed=seed)
    results = {}
    for layout in layouts:
        local = {name: split_sequence(t, rank, world_size, layout).clone() for name, t in inputs.items()}
        samples, stats = [], None
        for step in range(warmup + steps):
            q, k, v = (local[name].clone().requires_grad_() for name in ("q", "k", "v"))
            stats = RingStats()
            dist.barrier()
            start = time.perf_counter()
            out = ring_attention(q, k, v, layout=layout, stats=stats)
            out.backward(local["grad_out"])
            elapsed = _slowest(time.perf_counter() - start)
            if step >= warmup:
                samples.append(elapsed)
        results[layout] = {"step_samples": samples, "sent_elements": dict(stats.sent_elements),
                           "pairs": dict(stats.pairs), "blocks": dict(stats.blocks),
                           "block_elements": local["k"].numel()}
    return {"rank": rank, "threads": torch.get_num_threads(), "layouts": results}


def experts_bench(*, tokens: int = 2048, d_model: int = 128, hidden: int = 512, n_experts: int = 8, top_k: int = 2,
                  capacity_factor: float = 1.25, warmup: int = 1, steps: int = 5, seed: int = 0) -> dict:
    """An expert-parallel MoE layer (course_lib.expert_parallel), forward and backward of `tokens` tokens in all,
    tokens / N per rank: step time samples, every all_to_all_single's elements, the routing's kept and dropped."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if tokens % world_size:
        raise ValueError(f"tokens={tokens} do not split over {world_size} ranks")
    torch.manual_seed(seed)
    layer = ExpertParallelMoE(MoE(d_model, hidden, n_experts, top_k, capacity_factor))
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(tokens // world_size, d_model, generator=generator).requires_grad_()  # as inside a network
    calls, real = [], dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        calls.append(input.numel())
        return real(output, input, *args, **kwargs)

    samples = []
    with mock.patch.object(dist, "all_to_all_single", counting):
        for step in range(warmup + steps):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            calls.clear()
            dist.barrier()
            start = time.perf_counter()
            out, aux = layer(x)
            (out.square().mean() + 0.01 * aux).backward()
            elapsed = _slowest(time.perf_counter() - start)
            if step >= warmup:
                samples.append(elapsed)
    return {"rank": rank, "threads": torch.get_num_threads(), "step_samples": samples, "all_to_all_elements": list(calls),
            "stats": dict(layer.stats)}

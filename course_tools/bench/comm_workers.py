"""Rank workers that measure communication and data-parallel throughput (used by `make bench`).

    from course_lib.runtime.launch import launch
    from course_tools.bench.comm_workers import allreduce_bandwidth, ddp_throughput
    rows = launch(allreduce_bandwidth, world_size=2)[0]                  # list of {impl, size_mib, algbw_gbs, ...}
    result = launch(ddp_throughput, world_size=2, threads_per_rank=1)[0]

    .venv/bin/python scripts/bench.py --only comm      # both, at 2 and 4 ranks, printed as tables

Figures follow nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n for all-reduce, and the time
of an operation is the slowest rank's (a collective is only done when every rank is done).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.steps import train_step
from course_lib.data_parallel.collectives import ring_all_reduce, slowest
from course_lib.runtime.env import get_dist_info
from course_lib.parity import seeded_gpt

MIB = 2**20


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """busbw = algbw * 2 (n - 1) / n: the per-link traffic of a ring all-reduce, comparable across n."""
    return algbw * 2 * (world_size - 1) / world_size


def allreduce_bandwidth(sizes_mib=(1, 4, 16, 64), iters: int = 5, warmup: int = 1,
                        impls=("gloo", "ring")) -> list[dict]:
    """Median time of all_reduce (gloo's, and our ring) per message size; rows of algbw/busbw in GB/s.

    The implementations take turns (gloo, ring, gloo, ring, ...) so both see the same machine load.
    """
    info = get_dist_info()
    rows = []
    for size in sizes_mib:
        tensor = torch.ones(int(size * MIB) // 4, dtype=torch.float32, device=info.device)
        samples = {impl: [] for impl in impls}
        for i in range(warmup + iters):
            for impl in impls:
                dist.barrier()
                start = time.perf_counter()
                if impl == "gloo":
                    dist.all_reduce(tensor)
                else:
                    ring_all_reduce(tensor)
                elapsed = slowest(time.perf_counter() - start)
                if i >= warmup:
                    samples[impl].append(elapsed)
                tensor.fill_(1.0)
        for impl in impls:
            seconds = statistics.median(samples[impl])
            algbw = size * MIB / seconds / 1e9
            rows.append({"impl": impl, "size_mib": size, "world_size": info.world_size, "seconds": seconds,
                         "algbw_gbs": algbw, "busbw_gbs": bus_bandwidth(algbw, info.world_size)})
    return rows


def ddp_throughput(global_batch: int = 16, seq_len: int = 64, preset: str = "tiny", steps: int = 8,
                   warmup: int = 2, seed: int = 0) -> dict:
    """Tokens/s of torch DDP training at a fixed global batch, split evenly over the ranks.

    Each step is timed on the slowest rank; step_seconds is the median, step_samples every timed step
    (so that several launches taking turns can be pooled into one median).
    """
    info = get_dist_info()
    if global_batch % info.world_size:
        raise ValueError(f"global_batch ({global_batch}) must be divisible by world_size ({info.world_size})")
    model = seeded_gpt(seed, preset, block_size=max(seq_len, 8))
    ddp = DistributedDataParallel(model) if info.world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = global_batch // info.world_size
    generator = torch.Generator().manual_seed(seed + info.rank)
    times = []
    for step in range(warmup + steps):
        batch = torch.randint(0, model.config.vocab_size, (local, seq_len), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        train_step(ddp, [batch], optimizer, grad_norm=False)
        elapsed = slowest(time.perf_counter() - start)
        if step >= warmup:
            times.append(elapsed)
    seconds = statistics.median(times)
    return {"world_size": info.world_size, "threads_per_rank": torch.get_num_threads(),
            "global_batch": global_batch, "seq_len": seq_len, "step_seconds": seconds,
            "tokens_per_s": global_batch * seq_len / seconds, "step_samples": times}

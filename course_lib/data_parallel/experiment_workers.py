"""Rank workers of the data-parallel experiments: bucket sizes, world sizes, data per rank, scaling.

Each function runs inside every rank of a course_lib.runtime.launch job (a module, not a notebook cell, because
spawned ranks import their worker by name) and returns plain data for the notebook to check and plot:

    from course_lib import launch
    from course_lib.data_parallel.experiment_workers import bucket_sweep, scaling_sweep
    launch(bucket_sweep, 2, kwargs=dict(bucket_caps_mb=(0.25, 4.0)))        # step time per bucket size
    launch(scaling_sweep, 4, kwargs=dict(world_sizes=(1, 2, 4)))            # groups of 1, 2, 4 ranks take turns

The training loop with a DistributedSampler, accumulation and rank metrics is course_lib.data_parallel.torch_ddp.

Timing inside a job: a step is done when its slowest rank is done, so step times are all-reduced with MAX.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.data import load_tokens, prepare_tokens
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.data_parallel.loading import make_loader, rank_dataset
from course_lib.data_parallel.ddp import BucketedDataParallel, broadcast_parameters
from course_lib.data_parallel.torch_ddp import apply_ddp
from course_lib.data_parallel.workers import GRADIENT_SYNCS, data_parallel_run, ring_allreduce_check, timed_sync_step
from course_lib.observability.profiling import make_setup, medians, run_step
from course_lib.data_parallel.collectives import slowest
from course_lib.runtime.env import get_dist_info
from course_lib.runtime.launch import run_each
from course_lib.parity import flat_parameters, local_rows, seeded_gpt

log = logging.getLogger("course")  # course_lib.runtime.launch sends it to logs/rank_<r>/train.log


class TimedBucketedDataParallel(BucketedDataParallel):
    """BucketedDataParallel whose timeline holds each bucket's all_reduce from launch to its real completion
    (a callback on the collective's future), rather than to the moment finish_gradient_sync waited for it."""

    def __init__(self, module, bucket_cap_mb: float = 25.0, group=None):
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, group=group)
        self.completed: list[tuple[str, float, float]] = []

    def _grad_ready(self, param) -> None:
        super()._grad_ready(param)
        bucket = self._bucket_of[param]
        if self.require_sync and len(bucket.ready) == len(bucket.params):  # its all_reduce was just launched
            launched = bucket.launched_at
            bucket.handle.get_future().then(
                lambda _, launched=launched: self.completed.append(("allreduce", launched, time.monotonic())))

    def finish_gradient_sync(self) -> None:
        first = len(self.timeline)
        super().finish_gradient_sync()
        deadline = time.monotonic() + 5.0  # the callbacks run on the backend's thread, maybe just after wait()
        while len(self.completed) < len(self.buckets) and time.monotonic() < deadline:
            time.sleep(1e-4)
        self.timeline[first:] = sorted(self.completed, key=lambda interval: interval[1])  # this step's buckets
        self.completed = []


def bucket_sweep(bucket_caps_mb=(0.05, 0.25, 1.0, 4.0), steps: int = 6, warmup: int = 1, preset: str = "small",
                 local_batch: int = 4, seq_len: int = 64, timeline_variants=("naive", "0.25 MB"),
                 timeline_steps: int = 3, seed: int = 0) -> dict:
    """Forward + backward + gradient sync with the naive sync and with BucketedDataParallel at each bucket cap.

    The variants take turns step by step (naive, cap 1, cap 2, ..., naive, ...) on identical replicas and data.
    Per variant: all_reduce calls per step, median step time and median exposed communication (time from the end
    of backward to the end of the sync: what overlap failed to hide), both of the slowest rank. Then each of
    `timeline_variants` runs `timeline_steps` consecutive steps, whose (kind, start, end) intervals are returned.
    No optimizer step: the replicas stay as they are, and only what the sync changes is timed.
    """
    info = get_dist_info()
    variants = ["naive", *(f"{cap:g} MB" for cap in bucket_caps_mb)]
    unknown = set(timeline_variants) - set(variants)
    if unknown:
        raise ValueError(f"timeline_variants {sorted(unknown)} are not among the variants {variants}")
    replicas = {}
    for name, cap in zip(variants, (None, *bucket_caps_mb)):
        model = seeded_gpt(seed, preset, block_size=seq_len).to(info.device)
        if cap is None:
            broadcast_parameters(model)
            replicas[name] = (model, model)
        else:
            replicas[name] = (model, TimedBucketedDataParallel(model, bucket_cap_mb=cap))
    generator = torch.Generator().manual_seed(seed + 1 + info.rank)
    batch = torch.randint(0, 256, (local_batch, seq_len), generator=generator).to(info.device)
    step_s, exposed_s = {name: [] for name in variants}, {name: [] for name in variants}
    for step in range(warmup + steps):
        for name in variants:
            dist.barrier()  # every variant starts its step with all ranks together
            _, intervals = timed_sync_step(*replicas[name], batch)
            if step >= warmup:
                backward_end, end = intervals[1][2], intervals[-1][1]
                step_s[name].append(slowest(end - intervals[0][1]))
                exposed_s[name].append(slowest(end - backward_end))
    timelines = {name: [] for name in timeline_variants}
    for name in timeline_variants:
        dist.barrier()
        for _ in range(timeline_steps):
            timelines[name] += timed_sync_step(*replicas[name], batch)[1][:-1]
    results = {}
    for name, (model, wrapped) in replicas.items():
        calls = sum(p.requires_grad for p in model.parameters()) if wrapped is model else len(wrapped.buckets)
        results[name] = {"allreduces_per_step": calls, "median_step_s": statistics.median(step_s[name]),
                         "median_exposed_s": statistics.median(exposed_s[name])}
    return {"rank": info.rank, "threads": torch.get_num_threads(), "variants": results, "timelines": timelines,
            "param_mb": sum(p.numel() * p.element_size() for p in replicas["naive"][0].parameters()) / 2**20}


def parity_and_ring(steps: int = 3, numels=(1, 7, 1000, 4099)) -> dict:
    """data_parallel_run with every gradient sync, then ring_allreduce_check, in one job (one start-up)."""
    syncs = {sync: (data_parallel_run, dict(strategy=sync, steps=steps)) for sync in GRADIENT_SYNCS}
    return {"strategies": run_each(syncs), "ring": ring_allreduce_check(numels)}


def world_size_sweep(world_sizes=(1, 2, 4), steps: int = 8, warmup: int = 2, global_batch: int = 16,
                     seq_len: int = 64, preset: str = "tiny", seed: int = 0, data_dir: str = "data") -> dict:
    """The same training at several world sizes inside one job, taking turns step by step (a fair comparison).

    Launch max(world_sizes) ranks; the first n ranks form the group of world size n. Every group trains its own
    replica on the same global batches, split into n equal shards. Per group this rank is in: its local losses,
    the step times of the group's slowest rank (after warm-up) and its final parameters.
    """
    info = get_dist_info()
    if max(world_sizes) > info.world_size or any(global_batch % n for n in world_sizes):
        raise ValueError(f"launch max(world_sizes)={max(world_sizes)} ranks (got {info.world_size}) and pick a "
                         f"global_batch ({global_batch}) that every world size in {list(world_sizes)} divides")
    if info.rank == 0:
        prepare_tokens(data_dir, progress=False)
    dist.barrier()
    groups = {n: dist.new_group(list(range(n))) for n in world_sizes}  # every rank creates every group
    tokens = load_tokens("train", data_dir)
    generator = torch.Generator().manual_seed(seed)
    replicas = {}
    for n in world_sizes:
        if info.rank < n:
            model = seeded_gpt(seed, preset, block_size=seq_len).to(info.device)
            replicas[n] = (model, apply_ddp(model, info.device, groups[n]),
                           configure_optimizer(model, 3e-3))
    out = {n: {"losses": [], "step_s": []} for n in replicas}
    for step in range(warmup + steps):
        starts = torch.randint(0, len(tokens) - seq_len, (global_batch,), generator=generator)
        batch = tokens[starts[:, None] + torch.arange(seq_len)].long().to(info.device)  # the same on every rank
        for n in world_sizes:
            dist.barrier()  # one group at a time: the others wait here
            if n not in replicas:
                continue
            model, ddp, optimizer = replicas[n]
            rows = local_rows(batch, info.rank, n)
            start = time.perf_counter()
            loss = train_step(ddp, [rows], optimizer, grad_norm=False)["loss"]
            elapsed = slowest(time.perf_counter() - start, groups[n])
            out[n]["losses"].append(loss)
            if step >= warmup:
                out[n]["step_s"].append(elapsed)
    dist.barrier()
    for n, (model, _, _) in replicas.items():
        out[n]["params"] = flat_parameters(model)
    return {"rank": info.rank, "threads": torch.get_num_threads(), "groups": out}


def mapped_files(folder: str) -> list[str]:
    """Files under folder that this process has memory-mapped (Linux /proc/self/maps; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    folder = str(Path(folder).resolve())
    return sorted({Path(line.split()[-1]).name for line in lines if line.split()[-1].startswith(folder)})


def data_per_rank(shard_dir: str, seq_len: int = 64, micro_batch: int = 16, steps: int = 12,
                  configs=({"num_workers": 0}, {"num_workers": 2}), slow_rank: int = 1,
                  sample_delay_s: float = 0.004, seed: int = 0) -> dict:
    """Which shard files this rank maps, then DDP training where one rank's storage is slow, per config.

    Rank `slow_rank` reads every window with sample_delay_s of extra latency (a slow disk or a remote bucket);
    the others read at full speed. Per config and step: this rank's wait for data and the rest of the step
    (forward, backward with the gradient all-reduce, update). Medians after 2 warm-up steps.
    """
    info = get_dist_info()
    own = rank_dataset(shard_dir, info.rank, info.world_size, seq_len)
    for part in getattr(own, "datasets", [own]):  # a ConcatDataset when the rank owns several shards
        part.tokens()  # memory-maps this rank's shard files, and only those
    first = own[0]
    out = {"rank": info.rank, "mapped": mapped_files(shard_dir), "first_window": first[:12].tolist(), "configs": []}
    del own
    for config in configs:
        delay = sample_delay_s if info.rank == slow_rank else 0.0
        dataset = rank_dataset(shard_dir, info.rank, info.world_size, seq_len, sample_delay_s=delay)
        workers = config.get("num_workers", 0)
        loader = make_loader(dataset, micro_batch, shuffle=True, seed=seed, num_workers=workers,
                             prefetch_factor=config.get("prefetch_factor", 2))
        model = seeded_gpt(seed, "tiny", block_size=seq_len)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches, waits, rests = iter(loader), [], []
        warmup = 2 + workers * config.get("prefetch_factor", 2)  # drain what the workers prefetched
        dist.barrier()
        for step in range(warmup + steps):
            start = time.perf_counter()
            batch = next(batches)
            ready = time.perf_counter()
            train_step(ddp, [batch], optimizer, grad_norm=False)
            if step >= warmup:
                waits.append(ready - start)
                rests.append(time.perf_counter() - ready)
        del batches  # stop this config's workers before the next config starts its own
        out["configs"].append({**config, "slow": delay > 0, "wait_ms": 1e3 * statistics.median(waits),
                               "rest_ms": 1e3 * statistics.median(rests),
                               "step_ms": 1e3 * statistics.median(w + r for w, r in zip(waits, rests))})
    return out


def scaling_sweep(world_sizes=(1, 2, 4), steps: int = 10, warmup: int = 2, micro_batch: int = 8, seq_len: int = 64,
                  preset: str = "tiny", seed: int = 0) -> dict:
    """Step time versus world size at a fixed batch per rank, split into compute and communication.

    Launch max(world_sizes) ranks; the first n ranks form the group of world size n and the groups take turns
    step by step (the others wait at a barrier), so every world size sees the same machine load. A step is
    forward + backward (compute), one all_reduce of all gradients as a single flat buffer (communication),
    then the optimizer update (compute). The step time is the group's slowest rank; its compute part is the
    largest compute time of any rank in the group, and communication is the rest: the all_reduce itself plus
    waiting for the slowest rank to arrive.
    """
    info = get_dist_info()
    if max(world_sizes) > info.world_size:
        raise ValueError(f"launch max(world_sizes)={max(world_sizes)} ranks, got {info.world_size}")
    groups = {n: dist.new_group(list(range(n))) for n in world_sizes}  # every rank creates every group
    replicas = {}
    for n in world_sizes:
        if info.rank < n:
            model = seeded_gpt(seed, preset, block_size=seq_len)
            replicas[n] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(seed + 1 + info.rank)
    samples = {n: [] for n in replicas}
    for step in range(warmup + steps):
        for n in world_sizes:
            dist.barrier()  # one group at a time
            if n not in replicas:
                continue
            model, optimizer = replicas[n]
            batch = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=generator)
            marks = {}

            def average_flat(model=model, group=groups[n], n=n, marks=marks):
                marks["backward_done"] = time.perf_counter()
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # one message of 4N bytes
                dist.all_reduce(flat, group=group)
                marks["reduced"] = time.perf_counter()
                flat /= n
                offset = 0
                for p in model.parameters():
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()

            start = time.perf_counter()
            train_step(model, [batch], optimizer, after_backward=average_flat, grad_norm=False)
            end = time.perf_counter()
            mine = torch.tensor([(marks["backward_done"] - start) + (end - marks["reduced"]), end - start],
                                dtype=torch.float64, device=info.device)
            everyone = [torch.zeros(2, dtype=torch.float64, device=info.device) for _ in range(n)]
            dist.all_gather(everyone, mine, group=groups[n])
            if step >= warmup:
                compute = max(t[0].item() for t in everyone)
                total = max(t[1].item() for t in everyone)
                samples[n].append((compute, total))
    dist.barrier()
    results = {}
    for n, pairs in samples.items():
        model = replicas[n][0]
        compute = statistics.median(c for c, _ in pairs)
        step_s = statistics.median(t for _, t in pairs)
        results[n] = {"compute_s": compute, "step_s": step_s, "comm_s": max(step_s - compute, 0.0),
                      "grad_bytes": 4 * model.num_params(),
                      "tokens_per_s": n * micro_batch * seq_len / step_s, "params": flat_parameters(model)}
    return {"rank": info.rank, "threads": torch.get_num_threads(), "groups": results}


def allreduce_gradients_flat(model) -> int:
    """Average every gradient over the ranks with ONE all-reduce of a flat buffer (as one DDP bucket).
    Returns the bytes all-reduced."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def ddp_step_breakdown(preset: str = "tiny", batch_size: int = 16, steps: int = 10, warmup: int = 2, seed: int = 0,
                       data_dir: str | None = None, return_params: bool = False) -> dict:
    """Rank worker: phase medians with the all-reduce as its own phase, and torch DDP's overlapped step.

    Steps alternate A B A B (same machine load for both):
    A "separate": forward and backward under DDP's no_sync (no communication), then one timed all-reduce
      of all gradients: data + forward + backward + communication + optimizer, nothing overlapped;
    B "ddp": a normal DDP step, whose bucketed all-reduce runs while backward still computes.
    The all-reduce waits for the slowest rank, so "communication" includes any imbalance between ranks.
    return_params: also return the trained parameters, flattened (replicas must be identical).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, batches = make_setup(preset, batch_size, data_dir=data_dir, seed=seed, rank=rank)
    ddp = apply_ddp(model)  # no buffer sync before each forward: the rotary tables are constants
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def separate():
        return run_step(ddp, optimizer, batches, forward_context=ddp.no_sync,
                        communicate=lambda: allreduce_gradients_flat(model))

    def overlapped():
        return run_step(ddp, optimizer, batches)

    for _ in range(warmup):
        separate(), overlapped()
    samples = {"separate": [], "ddp": []}
    for _ in range(steps):
        samples["separate"].append(separate())
        samples["ddp"].append(overlapped())
    result = {"rank": rank, "world_size": world_size, "bytes": nbytes, "threads": torch.get_num_threads(),
              "separate": medians(samples["separate"]), "ddp": medians(samples["ddp"])}
    algbw = nbytes / result["separate"]["communication"]
    result["algbw_gb_s"], result["busbw_gb_s"] = algbw / 1e9, algbw * 2 * (world_size - 1) / world_size / 1e9
    if return_params:
        result["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return result

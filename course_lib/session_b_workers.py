"""Rank workers of Session B's experiments: collectives, bucket sizes, world sizes, loss scaling under DDP.

Each function runs inside every rank of a course_lib.launch job (a module, not a notebook cell, because spawned
ranks import their worker by name) and returns plain data for the notebook to check and plot:

    from course_lib.launch import launch
    from course_lib.session_b_workers import bucket_sweep, collectives_demo
    launch(collectives_demo, world_size=4)                                  # one dict per rank
    launch(bucket_sweep, 2, kwargs=dict(bucket_caps_mb=(0.25, 4.0)))        # step time per bucket size

The training loop with a DistributedSampler, accumulation and rank metrics is course_lib.ddp_training.

Timing inside a job: a step is done when its slowest rank is done, so step times are all-reduced with MAX.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from course_lib.data import load_tokens, prepare_tokens
from course_lib.ddp import BucketedDataParallel, allreduce_gradients, broadcast_parameters
from course_lib.ddp_training import flat_parameters, wrap_ddp
from course_lib.ddp_workers import all_strategies_run, ring_allreduce_check
from course_lib.dist import get_dist_info
from course_lib.model import GPT, GPTConfig
from course_lib.optim import configure_optimizer

log = logging.getLogger("course")  # course_lib.launch sends it to logs/rank_<r>/train.log


def collectives_demo() -> dict:
    """broadcast, all_reduce, reduce_scatter and all_gather on tiny tensors: {op: {'before', 'after'}} per rank."""
    info = get_dist_info()
    rank, world_size, device = info.rank, info.world_size, info.device
    out = {}

    def record(op, before, after):
        out[op] = {"before": before, "after": after.tolist()}
        log.info("%-14s before %s after %s", op, before, out[op]["after"])

    t = torch.tensor([100.0 + rank], device=device)  # every rank gets rank 0's value
    before = t.tolist()
    dist.broadcast(t, src=0)
    record("broadcast", before, t)
    t = torch.tensor([float(rank + 1)], device=device)  # every rank gets the sum 1 + 2 + ... + world_size
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    record("all_reduce", before, t)
    t = torch.arange(world_size, dtype=torch.float32, device=device) + 10 * rank  # rank j: sum of entries j
    result = torch.empty(1, device=device)
    dist.reduce_scatter(result, list(t.chunk(world_size)), op=dist.ReduceOp.SUM)
    record("reduce_scatter", t.tolist(), result)
    t = torch.tensor([float(rank**2)], device=device)  # every rank gets every rank's value, in rank order
    gathered = [torch.empty(1, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    record("all_gather", t.tolist(), torch.cat(gathered))
    return out


def _slowest(seconds: float, group=None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=get_dist_info().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


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
        super().finish_gradient_sync()
        deadline = time.monotonic() + 5.0  # the callbacks run on the backend's thread, maybe just after wait()
        while len(self.completed) < len(self.buckets) and time.monotonic() < deadline:
            time.sleep(1e-4)
        self.timeline = sorted(self.completed, key=lambda interval: interval[1])
        self.completed = []


def _sync_step(model, wrapped, batch) -> list[tuple[str, float, float]]:
    """Forward, backward and gradient sync of one variant; returns its (kind, start, end) intervals."""
    model.zero_grad(set_to_none=True)
    start = time.monotonic()
    _, loss = wrapped(batch, targets=batch)
    forward_end = time.monotonic()
    loss.backward()
    backward_end = time.monotonic()
    if wrapped is model:  # naive: every gradient's all_reduce after backward
        allreduce_gradients(model)
        comm = [("allreduce", backward_end, time.monotonic())]
    else:  # bucketed: the all_reduces were launched during backward; wait for them
        wrapped.finish_gradient_sync()
        comm = list(wrapped.timeline)
    intervals = [("forward", start, forward_end), ("backward", forward_end, backward_end), *comm]
    return intervals + [("step_end", time.monotonic(), time.monotonic())]


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
        torch.manual_seed(seed)
        model = GPT(GPTConfig.from_preset(preset, block_size=seq_len)).to(info.device)
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
            intervals = _sync_step(*replicas[name], batch)
            if step >= warmup:
                backward_end, end = intervals[1][2], intervals[-1][1]
                step_s[name].append(_slowest(end - intervals[0][1]))
                exposed_s[name].append(_slowest(end - backward_end))
    timelines = {name: [] for name in timeline_variants}
    for name in timeline_variants:
        dist.barrier()
        for _ in range(timeline_steps):
            timelines[name] += _sync_step(*replicas[name], batch)[:-1]
    results = {}
    for name, (model, wrapped) in replicas.items():
        calls = sum(p.requires_grad for p in model.parameters()) if wrapped is model else len(wrapped.buckets)
        results[name] = {"allreduces_per_step": calls, "median_step_s": statistics.median(step_s[name]),
                         "median_exposed_s": statistics.median(exposed_s[name])}
    return {"rank": info.rank, "threads": torch.get_num_threads(), "variants": results, "timelines": timelines,
            "param_mb": sum(p.numel() * p.element_size() for p in replicas["naive"][0].parameters()) / 2**20}


def parity_and_ring(steps: int = 3, numels=(1, 7, 1000, 4099)) -> dict:
    """course_lib.ddp_workers.all_strategies_run and ring_allreduce_check in one job (one start-up, not two)."""
    return {"strategies": all_strategies_run(steps), "ring": ring_allreduce_check(numels)}


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
            torch.manual_seed(seed)
            model = GPT(GPTConfig.from_preset(preset, block_size=seq_len)).to(info.device)
            replicas[n] = (model, wrap_ddp(model, info.device, groups[n]),
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
            shard = global_batch // n
            rows = batch[info.rank * shard:(info.rank + 1) * shard]
            start = time.perf_counter()
            _, loss = ddp(rows, targets=rows)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = _slowest(time.perf_counter() - start, groups[n])
            out[n]["losses"].append(loss.item())
            if step >= warmup:
                out[n]["step_s"].append(elapsed)
    dist.barrier()
    for n, (model, _, _) in replicas.items():
        out[n]["params"] = flat_parameters(model)
    return {"rank": info.rank, "threads": torch.get_num_threads(), "groups": out}


def amp_ddp_overflow(steps: int = 8, overflow_rank: int = 1, overflow_step: int = 3, init_scale: float = 2.0**10,
                     growth_interval: int = 3, local_batch: int = 4, seq_len: int = 32, seed: int = 0) -> dict:
    """fp16 autocast + GradScaler under torch DDP; one rank's gradients overflow at one step.

    The all-reduce spreads that rank's inf to every rank's averaged gradient, so every rank's GradScaler skips
    the same step and halves its scale: the replicas stay identical. Returns per-step records and final params.
    """
    info = get_dist_info()
    rank, device = info.rank, info.device
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset("tiny", block_size=seq_len)).to(device)
    ddp = wrap_ddp(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    records = []
    for step in range(steps):
        rows = torch.randint(0, 256, (local_batch, seq_len), generator=generator).to(device)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        with torch.autocast(device.type, dtype=torch.float16):
            _, loss = ddp(rows, targets=rows)
        scaled = scaler.scale(loss)
        injected = rank == overflow_rank and step == overflow_step
        if injected:
            scaled = scaled * 1e38  # a spike: this rank's gradients become inf
        scaled.backward()  # DDP averages the (scaled) gradients here, inf included
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        records.append({"step": step, "scale": scale, "skipped": skipped, "injected_here": injected,
                        "loss": loss.item()})
    return {"rank": rank, "records": records,
            "params": flat_parameters(model)}

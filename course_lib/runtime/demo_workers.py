"""Demo workers: what every rank of a job sees and does, started with course_lib.runtime.launch.

- `whoami`, `allreduce_demo`, `collectives_demo`: the rank environment and each collective on tiny tensors.
- `failing_worker`: a rank that raises, exits, is killed or hangs (how the launcher stops the others).
- `barrier_race`: why a reader waits at a barrier for the rank that writes.
- `train_logged`: DDP training that logs per rank, aggregates to rank 0 and writes ranked checkpoints.

They live in a module (not in a notebook cell) because spawned ranks import them by name:

    from course_lib import launch
    from course_lib.runtime.demo_workers import whoami
    launch(whoami, world_size=4)           # one dict per rank, in rank order
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.checkpoint.atomic import atomic_write
from course_lib.checkpoint.ranked import save_ranked_checkpoint
from course_lib.core.metrics import MetricsLogger
from course_lib.data_parallel.loading import ensure_shards, make_loader, rank_dataset
from course_lib.runtime.collectives import gather_to_rank0, mean_over_ranks, rank_tag
from course_lib.runtime.env import get_dist_info
from course_lib.testing import flat_parameters, seeded_gpt

log = logging.getLogger("course")  # course_lib.runtime.launch sends it to logs/rank_<r>/train.log


def whoami() -> dict:
    """The variables a launcher gives each rank, and what torch.distributed reports."""
    info = get_dist_info()
    env = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                 "MASTER_ADDR", "MASTER_PORT")}
    return {"rank": info.rank, "world_size": info.world_size, "backend": info.backend, "pid": os.getpid(),
            "device": str(info.device), "threads": torch.get_num_threads(), "env": env}


def allreduce_demo() -> dict:
    """Each rank contributes rank + 1; after all_reduce(SUM) every rank holds 1 + 2 + ... + world_size."""
    info = get_dist_info()
    tensor = torch.tensor([float(info.rank + 1)], device=info.device)
    before = tensor.item()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"contributed {before:g}, after all_reduce: {tensor.item():g}")
    return {"rank": info.rank, "before": before, "after": tensor.item()}


def all_reduce_steps(fault, steps: int = 5, step_seconds: float = 0.05) -> int:
    """Run `steps` steps of one all_reduce each; every rank calls fault(rank, step) at the start of each step.

    fault may raise or kill its own process; when it returns "skip", this rank skips the step's all_reduce (the
    classic rank-conditional collective). Returns the sum of the all-reduced values this rank received.
    """
    info = get_dist_info()
    total = torch.zeros(1, device=info.device)
    for step in range(steps):
        time.sleep(step_seconds)
        if fault(info.rank, step) == "skip":
            continue
        value = torch.ones(1, device=info.device)  # on the rank's device: an NCCL group has no CPU backend
        dist.all_reduce(value)
        total += value
    return int(total.item())


def failing_worker(fail_rank: int, mode: str = "raise", steps: int = 5, step_seconds: float = 0.05,
                   failed_at_file: str | None = None) -> int:
    """Run `steps` all_reduce steps; rank `fail_rank` fails at step 2.

    mode 'raise': raises ValueError. 'kill': the rank SIGKILLs itself (like the OOM killer).
    'skip': the rank skips one all_reduce, so the others wait in a collective it never joins.
    'stall': the rank never gets to its next all_reduce (a loop that waits for something that never comes).
    failed_at_file: if given, the failing rank writes the time of its failure there (for timing tests).
    """
    if mode not in ("raise", "kill", "skip", "stall"):
        raise ValueError(f"mode must be 'raise', 'kill', 'skip' or 'stall', got {mode!r}")
    info = get_dist_info()
    if not 0 <= fail_rank < info.world_size:
        raise ValueError(f"fail_rank {fail_rank} is not a rank of this job (world_size {info.world_size})")
    total = torch.zeros(1)
    for step in range(steps):
        time.sleep(step_seconds)
        if info.rank == fail_rank and step == 2:
            if failed_at_file:
                with open(failed_at_file, "w") as f:
                    f.write(repr(time.time()))
            if mode == "raise":
                raise ValueError(f"simulated failure in rank {info.rank} at step {step}")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "skip":
                continue
            while mode == "stall":
                time.sleep(0.05)
        value = torch.ones(1, device=info.device)
        dist.all_reduce(value)
        total += value.cpu()
    return int(total.item())


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


def barrier_race(directory: str, rounds: int = 3, save_seconds: float = 0.5) -> dict:
    """Each round rank 0 writes checkpoint `round` to latest.pt (slowly, as a large one would be written) and
    every rank then loads latest.pt, first without a barrier between the two, then with one. Without it the
    other ranks read what was there before: no file at all, or the previous round's. Returns, per variant,
    the step this rank loaded in each round ('missing' if there was no file)."""
    info = get_dist_info()
    path = Path(directory) / "latest.pt"
    out = {"rank": info.rank, "expected": list(range(1, rounds + 1))}
    for variant in ("without barrier", "with barrier"):
        if info.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        dist.barrier()  # both variants start from an empty directory
        loaded = []
        for step in range(1, rounds + 1):
            if info.rank == 0:
                time.sleep(save_seconds)
                atomic_write(path, lambda f, step=step: torch.save({"step": step, "weights": torch.full((4,), 1.0 * step)}, f))
                log.info("%s %s: saved step %d", rank_tag(), variant, step)
            if variant == "with barrier":
                dist.barrier()  # nobody reads before rank 0 has finished writing
            try:
                got = torch.load(path, weights_only=True)["step"]
            except FileNotFoundError:
                got = "missing"
            log.info("%s %s: expected step %d, loaded %s", rank_tag(), variant, step, got)
            loaded.append(got)
            dist.barrier()  # stands for the next training step's all_reduce, which lines the ranks up again
        out[variant] = loaded
    return out


def train_logged(out_dir: str, data_dir: str = "data", steps: int = 100, micro_batch: int = 8, seq_len: int = 64,
                 preset: str = "tiny", lr: float = 3e-3, seed: int = 0, log_every: int = 10, ckpt_every: int = 50,
                 num_workers: int = 0) -> dict:
    """torch DDP on this rank's token shards, with logs aggregated on rank 0 and ranked checkpoints.

    Every log_every steps: the mean loss over ranks (all_reduce, known everywhere) and every rank's own
    numbers (gather to rank 0), which rank 0 appends to <out_dir>/metrics.jsonl and writes as TensorBoard scalars
    to <out_dir>/tb (the mean loss and one loss curve per rank). Every ckpt_every steps and at
    the end: a ranked checkpoint in <out_dir>/step_<N>/.
    """
    info = get_dist_info()
    out = Path(out_dir)
    ensure_shards(data_dir, str(out / "shards"), num_shards=info.world_size)
    loader = make_loader(rank_dataset(out / "shards", info.rank, info.world_size, seq_len), micro_batch,
                         num_workers=num_workers, shuffle=True, seed=seed + info.rank)
    model = seeded_gpt(seed, preset, block_size=seq_len).to(info.device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    batches, local, rows, checkpoints = iter(loader), [], [], []
    metrics = MetricsLogger(out, tensorboard=True) if info.rank == 0 else None  # one writer: rank 0
    window = {"loss": [], "wait_s": [], "step_s": []}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:  # end of this rank's shard: next epoch (every rank has the same count)
            batches = iter(loader)
            batch = next(batches)
        ready = time.perf_counter()
        batch = batch.to(info.device)
        _, loss = ddp(batch, targets=batch)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window["loss"].append(loss.item())
        window["wait_s"].append(ready - start)
        window["step_s"].append(time.perf_counter() - start)
        local.append({"step": step, "loss": loss.item()})
        if step % log_every == 0 or step == steps:
            mine = {"rank": info.rank, "loss": statistics.mean(window["loss"]),
                    "wait_ms": 1e3 * statistics.median(window["wait_s"]),
                    "step_ms": 1e3 * statistics.median(window["step_s"]),
                    "tokens_per_s": micro_batch * seq_len / statistics.median(window["step_s"])}
            mean_loss = mean_over_ranks(mine["loss"])  # every rank knows it (e.g. to stop early together)
            per_rank = gather_to_rank0(mine)
            log.info("%s step %d | my loss %.4f | mean loss %.4f | wait %.1f ms | step %.1f ms", rank_tag(), step,
                     mine["loss"], mean_loss, mine["wait_ms"], mine["step_ms"])
            if info.rank == 0:
                row = {"step": step, "mean_loss": mean_loss, "tokens_per_s": sum(r["tokens_per_s"] for r in per_rank),
                       "slowest_step_ms": max(r["step_ms"] for r in per_rank),
                       **{f"loss_rank_{r['rank']}": r["loss"] for r in per_rank}, "per_rank": per_rank}
                metrics.log(row)  # a line of metrics.jsonl, and TensorBoard scalars in <out_dir>/tb: one per number
                rows.append(row)
            window = {key: [] for key in window}
        if step % ckpt_every == 0 or step == steps:
            directory = out / f"step_{step:05d}"
            save_ranked_checkpoint(directory, model, step=step, extra={"batches_read": step, "rank": info.rank})
            checkpoints.append(str(directory))
    if metrics is not None:
        metrics.close()
    return {"rank": info.rank, "local": local, "rows": rows, "checkpoints": checkpoints,
            "threads": torch.get_num_threads(), "params": flat_parameters(model)}

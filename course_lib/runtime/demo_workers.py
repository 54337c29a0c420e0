"""Demo workers: what every rank of a job sees and does, started with course_lib.runtime.launch.

- `whoami`, `allreduce_demo`, `collectives_demo`: the rank environment and each collective on tiny tensors.
- `failing_worker`: a rank that raises, exits, is killed or hangs (how the launcher stops the others).

(The checkpoint demos, `barrier_race` and `train_logged`, are in course_lib.checkpoint.workers.)

They live in a module (not in a notebook cell) because spawned ranks import them by name:

    from course_lib import launch
    from course_lib.runtime.demo_workers import whoami
    launch(whoami, world_size=4)           # one dict per rank, in rank order
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import torch.distributed as dist

from course_lib.runtime.env import get_dist_info

log = logging.getLogger("course")  # course_lib.runtime.launch sends it to logs/rank_<r>/train.log


def whoami() -> dict:
    """The variables a launcher gives each rank, and what torch.distributed reports."""
    info = get_dist_info()
    env = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                 "MASTER_ADDR", "MASTER_PORT")}
    return {"rank": info.rank, "world_size": info.world_size, "backend": info.backend, "pid": os.getpid(),
            "device": str(info.device), "threads": torch.get_num_threads(), "env": env}


def environment(names) -> dict:
    """The values of the environment variables `names` in this rank (None where unset), and its working folder."""
    return {"env": {name: os.environ.get(name) for name in names}, "cwd": os.getcwd()}


def say(text: str, seconds: float = 0.0) -> str:
    """Print `text` (to this rank's log), wait `seconds`, meet the other ranks at a barrier; returns text."""
    print(text, flush=True)
    time.sleep(seconds)
    dist.barrier()
    return text


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



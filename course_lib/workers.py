"""Small worker functions that notebooks and tests start on several ranks with course_lib.launch.

They live in a module (not in a notebook cell) because spawned ranks import them by name.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from course_lib.dist import get_dist_info


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
    tensor = torch.tensor([float(info.rank + 1)])
    before = tensor.item()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"contributed {before:g}, after all_reduce: {tensor.item():g}")
    return {"rank": info.rank, "before": before, "after": tensor.item()}


def failing_worker(fail_rank: int, mode: str = "raise", steps: int = 5, step_seconds: float = 0.05,
                   failed_at_file: str | None = None) -> int:
    """Run `steps` all_reduce steps; rank `fail_rank` fails at step 2.

    mode 'raise': raises ValueError. 'kill': the rank SIGKILLs itself (like the OOM killer).
    'skip': the rank skips one all_reduce, so the others wait in a collective it never joins.
    failed_at_file: if given, the failing rank writes the time of its failure there (for timing tests).
    """
    if mode not in ("raise", "kill", "skip"):
        raise ValueError(f"mode must be 'raise', 'kill' or 'skip', got {mode!r}")
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
        value = torch.ones(1)
        dist.all_reduce(value)
        total += value
    return int(total.item())

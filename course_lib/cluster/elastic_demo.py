"""A job whose rank crashes once, and torchrun's --max-restarts bringing it back.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1      # a fresh store per restart: book/cluster/torchrun.md
    torchrun --nproc_per_node=2 --max-restarts=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:29400 \\
        -m course_lib.cluster.elastic_demo
    # two "nodes" on one machine: run each line in its own terminal
    torchrun --nnodes=2 --nproc_per_node=1 --max-restarts=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:29400 \\
        --rdzv_id=demo -m course_lib.cluster.elastic_demo

Each torchrun agent counts the restarts of its own workers in TORCHELASTIC_RESTART_COUNT (0 at first). On
attempt 0, rank FAIL_RANK (environment, default 1) raises after the first all_reduce, as a rank hitting a bad
GPU or a NaN check would. Its agent sees the failure, stops its other workers and, while restarts remain,
joins a new round of the rendezvous; the agents of the other nodes see the new round, stop their workers
too, and every worker of the job starts again in a fresh process group. The count is per agent: a node
restarted because another node failed (a membership change) does not spend a restart and may still say 0.
On the next attempt nobody fails and the job exits 0. A real trainer resumes from its last checkpoint at
that point (course_lib.train --resume auto). FAIL_ATTEMPTS=2 fails twice: with --max-restarts=1 the job
then fails for good.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from course_lib.runtime.env import cleanup, init_distributed


def main() -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    fail_rank = int(os.environ.get("FAIL_RANK", 1))
    fail_attempts = int(os.environ.get("FAIL_ATTEMPTS", 1))
    info = init_distributed(timeout_s=float(os.environ.get("COURSE_DIST_TIMEOUT", 60)))
    print(f"attempt {attempt}: rank {info.rank} of {info.world_size} (node {os.environ.get('GROUP_RANK', '?')}, "
          f"local rank {info.local_rank}) joined", flush=True)
    total = torch.tensor([float(info.rank)], device=info.device)
    dist.all_reduce(total)  # everyone is here
    if info.rank == fail_rank and attempt < fail_attempts:
        print(f"attempt {attempt}: rank {info.rank} fails on purpose", flush=True)
        raise RuntimeError(f"simulated crash of rank {info.rank} on attempt {attempt}")
    dist.barrier()  # the others wait here; on a failing attempt their agent stops them
    ok = total.item() == info.world_size * (info.world_size - 1) / 2
    print(f"attempt {attempt}: rank {info.rank} finished ({'correct' if ok else 'WRONG'} all_reduce)", flush=True)
    cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

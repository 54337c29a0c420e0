"""What every rank of a (simulated) multi-node job does first: rendezvous, check the arithmetic, agree.

    python scripts/fake_multi_node_launcher.py --nnodes 2 --nproc_per_node 2     # runs this on 4 ranks

Each rank reads NODE_RANK / LOCAL_RANK / RANK / WORLD_SIZE, joins the process group through the TCPStore at
MASTER_ADDR:MASTER_PORT, checks RANK == NODE_RANK * NPROC_PER_NODE + LOCAL_RANK, all-reduces its rank (the sum
must be 0 + 1 + ... + WORLD_SIZE-1), gathers every rank's identity and meets the others at a barrier.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from course_lib.runtime.env import cleanup, init_distributed


def main() -> int:
    # The fake launcher exports NODE_RANK / NPROC_PER_NODE; torchrun exports GROUP_RANK / LOCAL_WORLD_SIZE instead.
    node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
    nproc = int(os.environ.get("NPROC_PER_NODE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
    info = init_distributed(timeout_s=float(os.environ.get("COURSE_DIST_TIMEOUT", 60)))
    expected = node_rank * nproc + info.local_rank
    print(f"joined: node {node_rank}, local rank {info.local_rank}, global rank {info.rank} of {info.world_size} "
          f"(rendezvous at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, backend {info.backend})")
    if info.rank != expected:
        print(f"RANK {info.rank} != NODE_RANK * NPROC_PER_NODE + LOCAL_RANK = {expected}", file=sys.stderr)
        return 1
    total = torch.tensor([float(info.rank)], device=info.device)
    dist.all_reduce(total)
    identities = [None] * info.world_size
    dist.all_gather_object(identities, {"rank": info.rank, "node": node_rank, "local_rank": info.local_rank,
                                        "host": socket.gethostname(), "pid": os.getpid()})
    ok = total.item() == info.world_size * (info.world_size - 1) / 2
    print(f"all_reduce of ranks = {total.item():g} ({'correct' if ok else 'WRONG'})")
    if info.rank == 0:
        for ident in identities:
            print(f"  rank {ident['rank']}: node {ident['node']}, local rank {ident['local_rank']}, pid {ident['pid']}")
    dist.barrier()
    print("passed the barrier")
    cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

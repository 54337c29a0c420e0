"""Rank workers that grade Session C's cluster exercises: joining a job from node variables, and an
evaluation averaged over ranks.

    ranks = launch(check_join_job, 4, args=(spawnable(join_job),), kwargs={"nproc_per_node": 2})
    ranks = launch(check_distributed_eval, 3, args=(spawnable(evaluate_on_ranks),))
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from course_lib.runtime.env import free_port
from course_lib.parity import seeded_gpt

NODE_VARIABLES = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_join_job(join_fn, *, nproc_per_node: int) -> dict:
    """Worker: leave the launcher's process group, then join a new job with join_fn from node variables only.

    This rank plays local rank (rank % nproc_per_node) of node (rank // nproc_per_node). The environment holds
    NODE_VARIABLES and no RANK or WORLD_SIZE, as on a node where a launcher starts nproc_per_node processes.
    Returns what join_fn returned, the rank and world size of the group it made, and every rank's (node,
    local rank) gathered over that group.
    """
    launched_rank, launched_world = dist.get_rank(), dist.get_world_size()
    port = [free_port() if launched_rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    node, local = divmod(launched_rank, nproc_per_node)
    environ = {"NNODES": str(launched_world // nproc_per_node), "NODE_RANK": str(node),
               "NPROC_PER_NODE": str(nproc_per_node), "LOCAL_RANK": str(local), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port[0])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)
    os.environ.update(environ)
    returned = join_fn(dict(environ))
    if not dist.is_initialized():
        raise RuntimeError("join_job returned without a process group: call dist.init_process_group")
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, (node, local))
    return {"node": node, "local_rank": local, "returned": returned, "rank": dist.get_rank(),
            "world_size": dist.get_world_size(), "places": places, "backend": dist.get_backend()}


EVAL_DROPOUT = 0.3


def eval_model(seed: int = 0):
    """The model every rank evaluates: dropout on, so evaluating in training mode gives other numbers."""
    return seeded_gpt(seed + 11, "tiny", dropout=EVAL_DROPOUT)


def eval_batches(rank: int, seed: int = 0) -> list[torch.Tensor]:
    """Rank r's held-out batches: r + 1 batches of r + 1 rows, sequences of 12 + 4r tokens (uneven on purpose)."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randint(0, 256, (rank + 1, 12 + 4 * rank), generator=generator) for _ in range(rank + 1)]


def check_distributed_eval(eval_fn, *, seed: int = 0) -> dict:
    """Worker: eval_fn(model, this rank's batches) on a model in training mode; what it returned and left."""
    rank = dist.get_rank()
    model = eval_model(seed).train()
    result = eval_fn(model, eval_batches(rank, seed))
    return {"rank": rank, "result": float(result) if isinstance(result, (torch.Tensor, float, int)) else result,
            "result_type": type(result).__name__, "training_after": model.training}


def eval_reference(world_size: int, seed: int = 0) -> float:
    """One process, every rank's batches: the mean loss per predicted token, in eval mode."""
    model = eval_model(seed).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for rank in range(world_size):
            for idx in eval_batches(rank, seed):
                n = idx[:, 1:].numel()
                total += model(idx, targets=idx)[1].item() * n
                tokens += n
    return total / tokens

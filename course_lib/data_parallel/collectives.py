"""Collectives written out, and the small ones every rank-side script needs.

- `ring_all_reduce`: all-reduce from send/recv, the algorithm NCCL uses for large messages.
- `mean_over_ranks`, `slowest`: one number reduced over the ranks (a mean; the max of a time, since a step is
  done only when its slowest rank is done), known to every rank.
- `gather_to_rank0`: every rank's object on rank 0, one message per rank.
- `shard_numel`: each rank's share of a vector split into equal (padded) chunks.
- `all_gather_single`, `reduce_scatter_single`: torch's one-tensor all-gather and reduce-scatter under their
  current names, or under the older ones on a torch that lacks them.
- `rank_tag`: '[node n | local l | rank r]' for log lines.

Ring all-reduce: the tensor is cut into world_size chunks. In the reduce-scatter phase each rank, for world_size - 1
steps, sends one chunk to its right neighbour and adds the chunk arriving from its left; afterwards rank r holds the
full sum of chunk (r + 1) % world_size. In the all-gather phase the finished chunks travel once more around the
ring. Each rank sends 2 (n - 1) / n of the tensor in total, whatever n is: the bandwidth term does not grow with the
number of ranks, which is why busbw = algbw * 2 (n - 1) / n.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from course_lib.runtime.env import get_dist_info


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over all ranks in place with a ring of send/recv, and return it."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    rank = dist.get_rank(group)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, world_size))  # views: updates land in `flat`
    receive = torch.empty_like(chunks[0]) if chunks[0].numel() else torch.empty(0, dtype=flat.dtype)

    def exchange(send_index: int, recv_index: int) -> torch.Tensor:
        # The send and the receive go out together: with NCCL, a send and a receive between the same two GPUs
        # (2 ranks: right == left) queue on one stream, and a blocking receive behind a send that waits for it
        # would never start. gloo would forgive isend + recv; NCCL needs the batch.
        incoming = receive[: chunks[recv_index].numel()]
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, chunks[send_index].contiguous(), _global(right, group), group),
            dist.P2POp(dist.irecv, incoming, _global(left, group), group)])
        for request in requests:
            request.wait()
        return incoming

    for step in range(world_size - 1):  # reduce-scatter: accumulate partial sums around the ring
        send_index, recv_index = (rank - step) % world_size, (rank - step - 1) % world_size
        chunks[recv_index].add_(exchange(send_index, recv_index))
    for step in range(world_size - 1):  # all-gather: pass the finished sums around
        send_index, recv_index = (rank + 1 - step) % world_size, (rank - step) % world_size
        chunks[recv_index].copy_(exchange(send_index, recv_index))
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each of world_size ranks holds when numel is split into equal parts: ceil(numel / world_size).

    Reduce-scatter and all-gather need equal chunks, so a flat vector is padded to world_size times this.
    """
    return -(-numel // world_size)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """The ranks' `input`s, concatenated in rank order, into `output` (world size x input.numel() numbers).

    torch 2.13 calls this collective `dist.all_gather_single`; its older name, `all_gather_into_tensor`, still
    works there but prints a FutureWarning on every rank. Older releases, such as the GPU nodes' 2.11, have
    only the older name. This calls the current name where it exists, the older one elsewhere.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Rank r's slice r of `input` (world size equal slices), reduced over the ranks with `op`, into `output`.

    `dist.reduce_scatter_single` in torch 2.13, `reduce_scatter_tensor` in older releases (see all_gather_single).
    """
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)


def _global(group_rank: int, group) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def slowest(seconds: float, group=None) -> float:
    """The largest of `seconds` over the ranks of `group`, known to every rank (all_reduce MAX)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=get_dist_info().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def rank_tag() -> str:
    """'[node n | local l | rank r]': where this process sits in the job (NODE_RANK, else rank // ranks per node)."""
    info = get_dist_info()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    node = int(os.environ.get("NODE_RANK", info.rank // max(per_node, 1)))
    return f"[node {node} | local {info.local_rank} | rank {info.rank}]"


def mean_over_ranks(value: float, group=None) -> float:
    """The mean of a number over the ranks, known to every rank (all_reduce SUM / n; gloo has no AVG)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=get_dist_info().device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.item() / dist.get_world_size(group)


def gather_to_rank0(obj) -> list | None:
    """Every rank's object, in rank order, on rank 0 (None elsewhere): one message per rank, not a file each."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered

"""Rank workers of the multi-GPU suite (tests/multigpu, `pytest -m multigpu`): each technique on the rank's own device.

Most techniques already have a worker that builds its model on `get_dist_info().device` (torch DDP, ZeRO, DTensor
tensor parallelism, pipeline parallelism): the suite runs those as they are. This module adds what is missing and
the frame around them:

- `on_rank_device(calls, expect=...)`: the worker every rank of the suite runs. It first checks that the rank is
  where the suite meant it to be ("cuda": an NCCL process group, this rank on cuda:<local rank>; "cpu": gloo on the
  CPU), turns TF32 off (the ranks compute in full fp32, as the one-process reference does), then runs `calls` as
  course_lib.runtime.launch.run_each does, under a deadline: a rank that is still inside its calls after
  `deadline_s` seconds (a send and a receive waiting for each other, which NCCL may not resolve where gloo does)
  writes every thread's Python stack to its log and exits, so the launcher reports it instead of hanging.
- `ring_all_reduce_on_device`: the course's ring all-reduce (send/recv) and dist.all_reduce on tensors made on the
  rank's device.
- `fsdp_train_on_device`: FSDP2 (course_lib.sharding.fsdp.apply_fsdp) with the model and the batches on the rank's
  device (course_lib.sharding.fsdp_workers.train_fsdp keeps its model on the CPU).

    from course_lib.runtime.launch import launch
    from course_lib.parallel.multigpu_workers import on_rank_device, ring_all_reduce_on_device
    ranks = launch(on_rank_device, 2, args=({"ring": (ring_all_reduce_on_device, {})},),
                   kwargs={"expect": "cuda"}, device="cuda", backend="cpu:gloo,cuda:nccl")
"""

from __future__ import annotations

import faulthandler

import torch
import torch.distributed as dist

from course_lib.core.steps import train_step
from course_lib.data_parallel.collectives import ring_all_reduce
from course_lib.data_parallel.workers import rank_tensor
from course_lib.parity import global_batches, local_rows, seeded_gpt
from course_lib.runtime.env import get_dist_info
from course_lib.runtime.launch import run_each
from course_lib.sharding.fsdp import apply_fsdp
from course_lib.tensor_parallel.dtensor import full_copy

EXPECTATIONS = ("cuda", "cpu")
RING_SHAPES = ((1,), (7,), (6, 5), (4099,), (1 << 20,))
"""A single element, chunks of unequal size, a 2-D tensor and 4 MiB (more than NCCL's buffers hold in flight)."""


def _cuda_backend_name(device: torch.device) -> str:
    """The class of the backend the default group uses for tensors on `device` ('ProcessGroupNCCL', ...)."""
    group = dist.distributed_c10d._get_default_group()
    try:
        return type(group._get_backend(device)).__name__
    except (AttributeError, RuntimeError) as err:  # no backend registered for that device type
        return f"none ({err})"


def check_placement(expect: str) -> dict:
    """Raise unless this rank is where the suite put it; return what it found (backend, device, backend class).

    expect="cuda": the process group's backend includes NCCL, the backend that serves CUDA tensors is NCCL, and
    this rank's device is cuda:<local rank>, the current CUDA device. expect="cpu": gloo, on the CPU.
    """
    if expect not in EXPECTATIONS:
        raise ValueError(f"expect must be one of {EXPECTATIONS}, got {expect!r}")
    info = get_dist_info()
    backend = dist.get_backend()
    found = {"rank": info.rank, "world_size": info.world_size, "backend": backend, "device": str(info.device)}
    if expect == "cuda":
        found["cuda_backend"] = _cuda_backend_name(torch.device("cuda", info.local_rank))
        problems = []
        if "nccl" not in backend:
            problems.append(f"the process group's backend is {backend!r}, not NCCL")
        if "NCCL" not in found["cuda_backend"]:
            problems.append(f"CUDA tensors are served by {found['cuda_backend']}, not ProcessGroupNCCL")
        if info.device != torch.device("cuda", info.local_rank):
            problems.append(f"the rank's device is {info.device}, not cuda:{info.local_rank}")
        elif torch.cuda.current_device() != info.local_rank:
            problems.append(f"the current CUDA device is {torch.cuda.current_device()}, not {info.local_rank}")
        if problems:
            raise RuntimeError(f"rank {info.rank}: " + "; ".join(problems))
    elif backend != "gloo" or info.device.type != "cpu":
        raise RuntimeError(f"rank {info.rank}: expected gloo on the CPU, got backend {backend!r} on {info.device}")
    return found


def on_rank_device(calls, *, expect: str = "cuda", deadline_s: float = 300.0) -> dict:
    """Worker: check_placement(expect), then run_each(calls) under a deadline.

    Returns {"placement": what check_placement found, "results": run_each's results, "peak_cuda_bytes": the most
    memory the calls had allocated on this rank's GPU (0 on the CPU)}.
    """
    placement = check_placement(expect)
    torch.set_float32_matmul_precision("highest")  # no TF32: the one-process reference computes in full fp32
    on_gpu = expect == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    faulthandler.dump_traceback_later(deadline_s, exit=True, file=2)  # fd 2 is the rank's log under launch
    try:
        results = run_each(calls)
    finally:
        faulthandler.cancel_dump_traceback_later()
    peak = torch.cuda.max_memory_allocated() if on_gpu else 0
    return {"placement": placement, "results": results, "peak_cuda_bytes": peak}


def ring_all_reduce_on_device(shapes=RING_SHAPES, seed: int = 0) -> list[dict]:
    """The course's ring all-reduce and dist.all_reduce of this rank's rank_tensor(rank, shape, seed), in fp32 on
    the rank's device; per shape the two results (on the CPU) and the device they were computed on."""
    info = get_dist_info()
    out = []
    for shape in shapes:
        mine = rank_tensor(info.rank, shape, seed, dtype=torch.float32).to(info.device)
        ring = ring_all_reduce(mine.clone())
        reference = mine.clone()
        dist.all_reduce(reference)
        out.append({"shape": tuple(shape), "device": str(ring.device), "ring": ring.cpu(),
                    "all_reduce": reference.cpu()})
    return out


def fsdp_train_on_device(strategy: str = "FULL_SHARD", *, steps: int = 3, rows_per_rank: int = 2, seq_len: int = 32,
                         preset: str = "tiny", lr: float = 0.5, seed: int = 0, grad_clip: float = 1.0) -> dict:
    """Worker: FSDP2 training on the rank's device, each rank on its rows of the same global batches.

    SGD, as course_lib.sharding.fsdp_workers.train_fsdp, so course_lib.sharding.fsdp_workers.train_one_process
    (optimizer="sgd") is its one-process reference. Returns the losses (this rank's rows), the full parameters
    after training (on the CPU), the device of this rank's shards and the device type of the FSDP mesh.
    """
    info = get_dist_info()
    model = seeded_gpt(seed, preset).to(info.device)
    apply_fsdp(model, strategy=strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in global_batches(steps, rows_per_rank * info.world_size, seq_len, seed):
        rows = local_rows(batch, info.rank, info.world_size).to(info.device)
        losses.append(train_step(model, [rows], optimizer, grad_clip=grad_clip)["loss"])
    weight = model.tok_emb.weight
    return {"rank": info.rank, "strategy": strategy, "losses": losses,
            "shard_device": str(weight.to_local().device), "mesh_device_type": weight.device_mesh.device_type,
            "params": {name: full_copy(param) for name, param in model.named_parameters()}}

"""What a training job's ranks do, in one value: data, ZeRO/FSDP sharding, tensor (+ sequence) and pipeline parallelism.

A `Layout` names a size per dimension and how each is done; its ranks form a (dp, pp, tp) device mesh, tensor
parallel fastest (consecutive ranks: one node's GPUs), as course_lib.hybrid.layout lays them out:

    Layout(dp=8)                                  8 replicas, torch DDP
    Layout(dp=8, ddp="scratch")                   the same with the course's bucketed all-reduce
    Layout(dp=8, zero=2)                          ZeRO-2 from scratch (optimizer states and gradients sharded)
    Layout(dp=8, fsdp=True)                       FSDP2 (parameters too)
    Layout(tp=2, sp=True)                         Megatron tensor + sequence parallelism
    Layout(pp=4, schedule="1f1b", micro_batches=8)
    Layout(dp=2, tp=2, pp=2)                      3D: 8 ranks

course_lib.parallel.compose applies it to a model; `python -m course_lib.train --dp 2 --tp 2 --pp 2` trains with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.core.checks import one_of, positive_int
from course_lib.hybrid.layout import DEFAULT_ORDER
from course_lib.pipeline_parallel.schedules import SCHEDULES

ZERO_STAGES = (0, 1, 2, 3)
DDP_IMPLEMENTATIONS = ("torch", "scratch")
"""How replicas average their gradients when nothing is sharded: torch's DistributedDataParallel, or the course's
BucketedDataParallel (course_lib.data_parallel.ddp)."""
MESH_DIMS = DEFAULT_ORDER
"""('dp', 'pp', 'tp'): the mesh dimensions from slowest- to fastest-varying rank."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The parallel layout of a job: dp * tp * pp ranks. Bad combinations are refused here, naming the field."""

    dp: int = 1
    """Data-parallel replicas: each takes its own rows of every global batch."""
    zero: int = 0
    """ZeRO stage from scratch over the dp ranks: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters."""
    fsdp: bool = False
    """Shard over the dp ranks with torch's FSDP2 instead (parameters, gradients and optimizer states)."""
    ddp: str = "torch"
    """Replicas without sharding average gradients with torch DDP ("torch") or the course's buckets ("scratch")."""
    tp: int = 1
    """Tensor-parallel ranks: every block's matrices are split over them (Megatron-LM, with torch DTensor)."""
    sp: bool = False
    """Sequence parallelism on top of tp: norms and the residual stream are split along the sequence."""
    pp: int = 1
    """Pipeline stages: each holds a contiguous run of blocks."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b or gpipe."""
    micro_batches: int | None = None
    """Micro-batches a pipeline step splits each replica's batch into; None: pp (the fewest that keep 1F1B full)."""

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            positive_int(f"Layout.{name}", getattr(self, name))
        one_of("Layout.zero", self.zero, ZERO_STAGES)
        one_of("Layout.ddp", self.ddp, DDP_IMPLEMENTATIONS)
        one_of("Layout.schedule", self.schedule, sorted(SCHEDULES))
        for name in ("fsdp", "sp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Layout.{name} must be True or False, got {getattr(self, name)!r}")
        if self.micro_batches is None:
            object.__setattr__(self, "micro_batches", self.pp)
        positive_int("Layout.micro_batches", self.micro_batches)
        if self.zero and self.fsdp:
            raise ValueError(f"Layout.zero={self.zero} and Layout.fsdp=True both shard the data-parallel ranks: "
                             "choose one (FSDP is ZeRO-3 in torch)")
        if self.sp and self.tp == 1:
            raise ValueError("Layout.sp=True needs Layout.tp > 1: sequence parallelism splits what tensor "
                             "parallelism keeps whole")
        if self.zero and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"Layout.zero={self.zero} runs over plain data parallelism only (tp=1, pp=1); with "
                             f"tp={self.tp}, pp={self.pp} use Layout.fsdp (tp) or zero=0")
        if self.fsdp and self.pp > 1:
            raise ValueError("Layout.fsdp=True with pp > 1 is not supported: shard the stages with zero=0 and "
                             "more replicas, or drop the pipeline")
        if self.sp and self.pp > 1:
            raise ValueError("Layout.sp=True with pp > 1 is not supported: the stages would pass "
                             "sequence-split activations; use sp with tp alone")
        if self.pp == 1 and self.micro_batches != 1:
            raise ValueError(f"Layout.micro_batches={self.micro_batches} needs pipeline stages (pp > 1); without a "
                             "pipeline, accumulate with grad_accum_steps")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    @property
    def sharded(self) -> bool:
        """Does any rank hold only part of the training state (so a checkpoint needs every rank)?"""
        return bool(self.zero or self.fsdp or self.tp > 1 or self.pp > 1)

    def name(self) -> str:
        """Short and unique: 'single', 'dp4', 'dp2 zero1', 'tp2 sp', 'dp2 tp2 pp2 1f1b m4'."""
        parts = [f"{dim}{size}" for dim, size in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if size > 1]
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.fsdp:
            parts.append("fsdp")
        if self.dp > 1 and not (self.zero or self.fsdp) and self.ddp != "torch":
            parts.append(f"ddp-{self.ddp}")
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts += [self.schedule, f"m{self.micro_batches}"]
        return " ".join(parts) or "single"

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(f"the layout {self.name()!r} needs dp * tp * pp = {self.dp} * {self.tp} * {self.pp} = "
                             f"{self.world_size} ranks, but the job has {world_size}: start it with "
                             f"--nproc_per_node={self.world_size} (or change --dp)")

    @classmethod
    def for_world(cls, world_size: int, *, dp: int | None = None, **fields) -> "Layout":
        """The layout with dp = world_size / (tp * pp) when dp is None (torchrun decides the world size)."""
        tp, pp = fields.get("tp", 1), fields.get("pp", 1)
        if dp is None:
            positive_int("Layout.tp", tp)
            positive_int("Layout.pp", pp)
            if world_size % (tp * pp):
                raise ValueError(f"the job's {world_size} ranks do not split into tp * pp = {tp} * {pp} = "
                                 f"{tp * pp} ranks per replica: choose tp and pp whose product divides {world_size}")
            dp = world_size // (tp * pp)
        layout = cls(dp=dp, **fields)
        layout.check_world_size(world_size)
        return layout


def build_mesh(layout: Layout, device_type: str = "cpu"):
    """The job's ('dp', 'pp', 'tp') DeviceMesh (call on every rank; the process group must be up)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    layout.check_world_size(dist.get_world_size())
    return init_device_mesh(device_type, tuple(layout.sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)

"""Fully sharded data parallelism with torch's FSDP2 (`torch.distributed.fsdp.fully_shard`), applied to the GPT.

Every rank keeps 1/N of each parameter, of its gradient and of the optimizer states (ZeRO stage 3). Before a
block runs, its parameters are all-gathered; after its backward, its gradients are reduce-scattered, so each
rank receives the average of its own shard only. The model code does not change: `apply_fsdp` wraps it.

    from course_lib.sharding.fsdp import apply_fsdp, mixed_precision_policy
    model = apply_fsdp(GPT(config), strategy="FULL_SHARD", mp_policy=mixed_precision_policy("bf16"))
    optimizer = configure_optimizer(model, lr)      # built AFTER sharding: it must see the DTensor shards

    torchrun --nproc_per_node=2 -m course_lib.train --strategy fsdp --model_size medium --max_steps 50
    python -m course_lib.sharding.fsdp                        # prints the strategy table and the precision policies

Wrapping (FSDP1's auto_wrap_policy) is a loop here: `fully_shard` every transformer Block, then the root. Each
call makes one communication group: one all-gather before that block's forward (and backward), one
reduce-scatter after its backward. Per-block groups mean only one block is ever unsharded at a time and
block i+1's all-gather can overlap block i's compute; wrapping only the root would gather the whole model at
once (no memory saved while computing), and wrapping every Linear would send many tiny messages.

Padding (torch's rule): a parameter of shape (d0, ...) is split along dim 0 in torch.chunk's way, ceil(d0 / S)
rows per rank over a shard group of S ranks; each rank's storage holds ceil(d0 / S) rows (the last ranks'
tails are zeros). `expected_fsdp_model_states` turns this rule into bytes per rank.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from course_lib.core.checks import positive_int
from course_lib.core.model import Block
from course_lib.sharding.model_states import STEP_COUNTER_BYTES


@dataclass(frozen=True)
class ShardingStrategy:
    """One FSDP1 ShardingStrategy name, as ZeRO stage and FSDP2 settings."""

    zero_stage: int
    """ZeRO stage of the model states at rest: 0 = DDP, 2 = gradients + optimizer, 3 = also parameters."""
    reshard_after_forward: bool
    """fully_shard's flag: free the gathered parameters after forward (True) or keep them until backward."""
    mesh: str
    """'shard' (1-D mesh of all ranks), 'replicate' (N x 1: shard groups of one rank) or 'hybrid' (nodes x ranks)."""
    what: str


SHARDING_STRATEGIES = {
    # name: ShardingStrategy(ZeRO stage, reshard after forward, mesh, what is sharded)
    "FULL_SHARD": ShardingStrategy(3, True, "shard", "parameters, gradients and optimizer states sharded over all "
                                   "ranks; parameters gathered for forward, freed, gathered again for backward"),
    "SHARD_GRAD_OP": ShardingStrategy(2, False, "shard", "gradients and optimizer states sharded; parameters "
                                      "gathered once per step and kept unsharded from forward to the end of backward"),
    "NO_SHARD": ShardingStrategy(0, False, "replicate", "plain data parallelism (DDP): every rank holds everything, "
                                 "gradients all-reduced"),
    "HYBRID_SHARD": ShardingStrategy(3, True, "hybrid", "FULL_SHARD inside each node, replicas across nodes: "
                                     "parameter traffic stays on the fast intra-node links"),
}
"""FSDP1's ShardingStrategy names -> ZeRO stage and FSDP2 settings (`python -m course_lib.sharding.fsdp` prints it).

FSDP2 has no strategy argument: the mesh and reshard_after_forward say the same thing. A 2-D mesh
(replicate, shard) shards over its second dimension and replicates over its first (HSDP); shard groups
of one rank make NO_SHARD. SHARD_GRAD_OP is ZeRO-2 during the optimizer step; between forward and backward
it holds the full parameters, as DeepSpeed's ZeRO-2 does all the time.
"""

PRECISION_POLICIES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float32),
}
"""precision -> (param_dtype: what forward/backward compute in, reduce_dtype: what gradients are averaged in)."""


def check_strategy(strategy: str) -> ShardingStrategy:
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"unknown FSDP sharding strategy {strategy!r}; choose one of {list(SHARDING_STRATEGIES)}")
    return SHARDING_STRATEGIES[strategy]


def fsdp_mesh_shape(strategy: str, world_size: int, ranks_per_node: int | None = None) -> tuple[int, ...]:
    """(world_size,) for a 1-D shard mesh; (replicas, shard group size) for a 2-D one.

    ranks_per_node (HYBRID_SHARD's shard group; default LOCAL_WORLD_SIZE, as torchrun sets it) must divide
    world_size.
    """
    mesh = check_strategy(strategy).mesh
    positive_int("world_size", world_size)
    if mesh == "shard":
        return (world_size,)
    if mesh == "replicate":
        return (world_size, 1)
    ranks_per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"HYBRID_SHARD shards over the ranks of a node: ranks_per_node ({ranks_per_node}) must "
                         f"divide world_size ({world_size})")
    return (world_size // ranks_per_node, ranks_per_node)


def build_mesh(strategy: str = "FULL_SHARD", *, world_size: int | None = None, ranks_per_node: int | None = None,
               device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh a strategy shards over (needs an initialised process group)."""
    shape = fsdp_mesh_shape(strategy, world_size or dist.get_world_size(), ranks_per_node)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mixed_precision_policy(precision: str = "fp32") -> MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy for 'fp32', 'bf16' or 'fp16'.

    The sharded parameters stay fp32 (they are the optimizer's master weights); each all-gather casts them
    to param_dtype for compute. Gradients are reduce-scattered in fp32: a sum of N low-precision gradients
    loses the small ones (bf16 keeps 8 significant bits). fp16 compute also needs loss scaling (a GradScaler).
    """
    if precision not in PRECISION_POLICIES:
        raise ValueError(f"unknown precision {precision!r} for a mixed-precision policy; "
                         f"choose one of {list(PRECISION_POLICIES)}")
    param_dtype, reduce_dtype = PRECISION_POLICIES[precision]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def precision_of(dtype: torch.dtype | None) -> str:
    """The PRECISION_POLICIES name of an autocast dtype (None = fp32)."""
    return {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh | None = None, strategy: str = "FULL_SHARD",
                mp_policy: MixedPrecisionPolicy | None = None, offload: bool = False,
                ranks_per_node: int | None = None) -> nn.Module:
    """fully_shard every transformer Block, then the root; returns `model` (now also an FSDPModule).

    mesh: default build_mesh(strategy) on the parameters' device type. offload: keep the shards (and run
    the optimizer) on the CPU between uses (CPUOffloadPolicy; pinned memory only with CUDA).
    """
    settings = check_strategy(strategy)
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (see mixed_precision_policy), got {mp_policy!r}")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no course_lib.core.model.Block to wrap")
    device_type = next(model.parameters()).device.type
    mesh = mesh or build_mesh(strategy, ranks_per_node=ranks_per_node, device_type=device_type)
    if settings.mesh != "shard" and mesh.ndim != 2:
        raise ValueError(f"{strategy} needs a 2-D (replicate, shard) mesh, got a {mesh.ndim}-D mesh")
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=settings.reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload_policy)
    for block in blocks:  # bottom-up: each call takes the parameters no earlier call took
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)  # the rest: embedding (tied with lm_head) and the final norm
    return model


# ------------------------------------------------------------------------------------------ DeepSpeed
DEEPSPEED_STAGES = {0: "NO_SHARD", 1: None, 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
"""DeepSpeed zero_optimization.stage -> FSDP strategy. Stage 1 (optimizer states only) has no FSDP strategy:
torch's equivalent is DDP + torch.distributed.optim.ZeroRedundancyOptimizer."""


def deepspeed_equivalent(ds_config: dict) -> dict:
    """What a DeepSpeed JSON config (e.g. config/deepspeed_zero3.json) asks for, in FSDP2 terms.

    offload: DeepSpeed offloads optimizer and parameters separately, to cpu or nvme; FSDP2's CPUOffloadPolicy
    moves both (and the optimizer step) to the CPU, and has no NVMe tier.
    """
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in DEEPSPEED_STAGES:
        raise ValueError(f"zero_optimization.stage must be one of {list(DEEPSPEED_STAGES)}, got {stage!r}")
    offload = {kind: zero.get(f"offload_{kind}", {}).get("device", "none") for kind in ("optimizer", "param")}
    precision = ("bf16" if ds_config.get("bf16", {}).get("enabled") else
                 "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32")
    strategy = DEEPSPEED_STAGES[stage]
    return {"zero_stage": stage, "strategy": strategy, "precision": precision, "offload": offload,
            "torch": ("DDP + ZeroRedundancyOptimizer" if strategy is None else
                      f"apply_fsdp(model, strategy={strategy!r}, mp_policy=mixed_precision_policy({precision!r})"
                      + (", offload=True" if "cpu" in offload.values() else "") + ")"
                      + ("  # no NVMe tier in FSDP" if "nvme" in offload.values() else ""))}


# ------------------------------------------------------------------------------------------ memory per rank
def shard_rows(dim0: int, shard_size: int, shard_index: int) -> tuple[int, int]:
    """(rows shard `shard_index` holds, rows its padded storage has) for a dim 0 of `dim0` rows over S ranks."""
    padded = math.ceil(dim0 / shard_size)
    return max(0, min(padded, dim0 - shard_index * padded)), padded


def expected_fsdp_model_states(model: nn.Module, world_size: int, rank: int, *, strategy: str = "FULL_SHARD",
                               ranks_per_node: int | None = None, optimizer: str = "adamw") -> dict:
    """Bytes of model states rank `rank` holds after an optimizer step, predicted from parameter shapes; the
    same keys as course_lib.sharding.model_states.measure_model_states, which must agree to the byte.

    model: the plain or the sharded model (a DTensor's .shape is the full shape); parameters in their dtype.
    - params: padded shard storage, ceil(d0 / S) rows per parameter;
    - grads: the same, padded (each group's gradients are views into one reduce-scatter output);
    - optimizer_states (adamw): exp_avg and exp_avg_sq shaped like the unpadded local shard (zeros_like of
      the shard), plus step_counters: a 4-byte fp32 `step` per parameter. S = the shard group size.
    """
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    shard_size = fsdp_mesh_shape(strategy, world_size, ranks_per_node)[-1]
    shard_index = rank % shard_size  # mesh (replicas, S) is laid out row-major over the ranks
    params = grads = states = counters = 0
    for param in {id(p): p for p in model.parameters()}.values():  # a tied tensor once
        rows, padded = shard_rows(param.shape[0], shard_size, shard_index)
        row_bytes = math.prod(param.shape[1:]) * param.element_size()
        params += padded * row_bytes
        grads += padded * row_bytes
        if optimizer == "adamw":
            states += 2 * rows * row_bytes
            counters += STEP_COUNTER_BYTES
    return {"params": params, "grads": grads, "optimizer_states": states + counters, "step_counters": counters,
            "total": params + grads + states + counters}


def local_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{name: (full shape, this rank's shard shape)} of a sharded model's parameters."""
    return {name: (tuple(p.shape), tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape))
            for name, p in model.named_parameters()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--ranks_per_node", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"{'FSDP1 name':<15}{'ZeRO':>5}  {'reshard_after_forward':<23}{'mesh (N=' + str(args.world_size) + ')':<13}")
    for name, s in SHARDING_STRATEGIES.items():
        shape = fsdp_mesh_shape(name, args.world_size, args.ranks_per_node)
        print(f"{name:<15}{s.zero_stage:>5}  {str(s.reshard_after_forward):<23}{str(shape):<13}{s.what}")
    for precision in PRECISION_POLICIES:
        policy = mixed_precision_policy(precision)
        print(f"{precision}: param_dtype={policy.param_dtype}, reduce_dtype={policy.reduce_dtype}")


if __name__ == "__main__":
    main()

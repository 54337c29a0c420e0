"""Sharded data parallelism: ZeRO stages 1-3 from scratch, FSDP2, and the model-state bytes each rank holds.

    from course_lib.sharding import apply_zero, apply_fsdp
"""

from course_lib import lazy_exports
from course_lib.sharding.zero import ZeroOptimizer
from course_lib.sharding.zero3 import Zero3Optimizer

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "fsdp": ("ShardingStrategy", "SHARDING_STRATEGIES", "PRECISION_POLICIES", "check_strategy", "fsdp_mesh_shape", "build_mesh",
             "mixed_precision_policy", "precision_of", "apply_fsdp", "DEEPSPEED_STAGES",
             "deepspeed_equivalent", "shard_rows", "expected_fsdp_model_states", "local_shapes"),
    "memory": ("KINDS", "SHARDED_FROM_STAGE", "STEP_COUNTER_BYTES", "local_tensor", "live_bytes",
               "measure_model_states", "expected_model_states"),
    "zero": ("STAGES", "COMPUTE_DTYPES", "FlatLayout", "ShardedAdamW"),
    "zero3": ("Unit", "default_units"),
})
__all__ += ["ZeroOptimizer", "Zero3Optimizer", "apply_zero"]


def apply_zero(model, stage: int, **kwargs) -> ZeroOptimizer:
    """Shard `model`'s training state with ZeRO `stage` (0-3); kwargs as ZeroOptimizer (lr, weight_decay, ...).

    Stage 3 changes the model in place: its parameters then hold data only between the forward pre-hook
    that gathers them and the hook that frees them (see course_lib.sharding.zero3).
    """
    if stage == 3:
        return Zero3Optimizer(model, **kwargs)
    return ZeroOptimizer(model, stage, **kwargs)

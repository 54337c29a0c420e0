"""Sharded data parallelism: ZeRO stages 1-3 from scratch, FSDP2, and the model-state bytes each rank holds.

    from course_lib.sharding import apply_zero, apply_fsdp
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "fsdp": ("ShardingStrategy", "SHARDING_STRATEGIES", "PRECISION_POLICIES", "check_strategy", "fsdp_mesh_shape",
             "build_mesh", "mixed_precision_policy", "precision_of", "apply_fsdp", "DEEPSPEED_STAGES",
             "deepspeed_equivalent", "shard_rows", "expected_fsdp_model_states", "local_shapes"),
    "model_states": ("KINDS", "SHARDED_FROM_STAGE", "STEP_COUNTER_BYTES", "local_tensor", "live_bytes",
                     "measure_model_states", "expected_model_states"),
    "zero": ("STAGES", "COMPUTE_DTYPES", "FlatLayout", "ShardedAdamW", "ZeroOptimizer", "ZeroAdamW"),
    "zero3": ("Unit", "default_units", "Zero3Optimizer", "apply_zero"),
    "zero_workers": ("MODEL_OVERRIDES", "MODEL_PRESET", "make_model", "reference_run", "zero_parity_run",
                     "check_zero", "check_zero3", "zero_reference", "zero3_reference", "zero3_unit_bytes",
                     "ZERO3_UNITS"),
})

"""Tensor parallelism: Megatron's column- and row-parallel layers from scratch, then the same plan with DTensor.

    from course_lib.tensor_parallel import apply_tensor_parallel, apply_dtensor_tp
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "dtensor": ("make_tp_mesh", "block_plan", "apply_dtensor_tp", "full_copy", "gather_full_dtensor",
                "CollectiveCounter"),
    "tp_layers": ("TP_ALLREDUCES_PER_LAYER", "CommStats", "CopyToParallelRegion", "ReduceFromParallelRegion",
                  "copy_to_parallel_region", "reduce_from_parallel_region", "ColumnParallelLinear",
                  "RowParallelLinear", "check_tensor_parallel_config", "apply_tensor_parallel",
                  "apply_tensor_parallel_attention", "gather_full",
                  "replicated_parameter_names", "tp_allreduce_bytes_per_layer"),
    "workers": ("DEFAULT_RUNS", "compare_with_reference", "reference_run", "tp_checks", "BLOCK_ROWS", "BLOCK_SEQ",
                "HIDDEN", "ROWS", "TP_LINEARS", "check_megatron_regions", "check_tensor_parallel_block",
                "megatron_regions_reference", "tp_block_reference"),
    "sequence_parallel": ("gather_sequence", "reduce_scatter_sequence", "GatherFromSequenceParallelRegion",
                          "ReduceScatterToSequenceParallelRegion", "gather_from_sequence_parallel_region",
                          "reduce_scatter_to_sequence_parallel_region", "apply_sequence_parallel_block",
                          "allreduce_sequence_parallel_grads"),
    "sp_workers": ("check_sequence_parallel_block", "sequence_parallel_reference"),
})

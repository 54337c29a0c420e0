"""Where memory goes: bytes per parameter, model states, activations (measured and predicted), the per-GPU calculator.

    from course_lib.memory import memory_per_gpu, measure_saved_bytes
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "accounting": ("PRECISION_BYTES", "OPTIMIZER_STATES", "GPU_80GB", "MemoryEstimate", "count_parameters",
                   "estimate_training_memory", "measure_training_memory", "format_bytes", "memory_table"),
    "activations": ("DTYPE_BYTES", "AMP_DTYPES", "SavedBytes", "layer_terms", "head_terms", "expected_saved_bytes",
                    "RECOMPUTE", "korthikanti_bytes_per_layer", "count_saved_bytes", "measure_saved_bytes"),
    "calculator": ("H100_80GB", "MODELS", "SHAPE_ALIASES", "KINDS", "MemoryBreakdown", "resolve_model",
                   "activation_bytes", "memory_per_gpu", "plot_memory_breakdown", "memory_calculator_figure",
                   "MemoryCalculator", "memory_calculator_widget"),
    "formulas": ("ADAM_STATE_BYTES", "ZERO_STAGES", "ZeroMemory", "zero_memory_per_gpu", "zero_table",
                 "data_parallel_traffic", "comm_seconds", "compute_seconds", "break_even_tokens_per_gpu",
                 "checkpoint_bytes", "young_interval", "expected_waste"),
})

"""Seeing what a run does: timing, per-rank timelines, the profiler and MFU, experiment logs, GPU
monitoring, fused kernels.

    from course_lib.observability import time_alternating, profile_steps
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "experiment_log": ("wandb_available", "gradient_norms", "log_gradients", "log_throughput",
                       "read_tensorboard_scalars", "read_wandb_history"),
    "kernel_comparisons": ("ADAMW_IMPLS", "NOT_KERNELS", "OpCall", "record_ops", "op_summary", "silu_comparison",
                           "make_adamw", "adamw_comparison", "attention_comparison", "format_rows"),
    "gpu_monitor": ("MIB", "QUERY_FIELDS", "NVIDIA_SMI_TIMEOUT_S", "GPUStat", "GPUSnapshot",
                    "parse_nvidia_smi_csv", "gpu_snapshot", "summarise_allocator", "torch_memory",
                    "format_snapshot", "allocator_line"),
    "profiling": ("PHASES", "CATEGORIES", "MATMUL_OPS", "MATMUL_CEILING_N", "GPU_PEAK_TFLOPS", "make_setup",
                  "run_step", "medians", "step_breakdown", "without_profiler_banner", "ProfileReport",
                  "profile_steps", "gpu_peak_flops", "throughput_report", "measure_throughput", "format_breakdown",
                  "op_category", "category_shares"),
    "timeline": ("COLORS", "Timeline", "plot_timelines"),
    "timing": ("Timing", "time_fn", "time_alternating", "setup_threads", "cpu_model", "machine_info",
               "machine_line"),
})

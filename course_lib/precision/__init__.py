"""Mixed precision: number ranges, autocast, loss scaling, and fp32 / bf16 / fp16 runs compared.

    from course_lib.precision import loss_scaling_run
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "amp": ("DTYPES", "range_table", "dtype_limits", "loss_scaling_run", "underflow_demo"),
    "comparison": ("AMP_DTYPES", "precision_comparison", "max_loss_gap", "step_noise", "gradient_sample",
                   "underflow_fractions"),
    "workers": ("amp_ddp_overflow",),
})

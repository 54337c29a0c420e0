"""The course's training loop under Hugging Face Accelerate and under DeepSpeed.

    from course_lib.integrations import accelerate_train
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "accelerate_train": ("PRECISION_TO_ACCELERATE", "train_with_accelerate"),
    "deepspeed_train": ("FLAG_TO_DEEPSPEED", "json_precision", "resolve_configs", "explicit_flags",
                        "train_with_deepspeed", "build_deepspeed_parser"),
})

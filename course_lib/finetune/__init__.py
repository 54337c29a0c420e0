"""Fine-tuning: LoRA adapters on the course GPT.

    from course_lib.finetune import apply_lora
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "lora": ("ATTENTION_TARGETS", "MLP_TARGETS", "DEFAULT_TARGETS", "LoRALinear", "apply_lora", "merge_lora",
             "lora_state_dict", "parameter_counts", "lora_parameter_count", "fine_tuning_memory",
             "optimizer_state_bytes", "fine_tuning_text", "split_text", "fine_tune", "lora_memory_table"),
})

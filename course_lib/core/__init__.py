"""The model and what one process needs to train it: GPT and its config, data, optimizer, one step,
device, metrics, a trained tokenizer.

    from course_lib.core import GPT, GPTConfig, train_step
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("DEFAULT_CONFIG", "JSON_TO_FIELD", "FIELD_TO_JSON", "config_from_dict", "load_model_config",
               "config_to_json_dict", "add_dataclass_arguments"),
    "data": ("CORPUS_FILE", "SPLITS", "SYNTHETIC_KINDS", "ByteTokenizer", "load_corpus", "corpus_stats",
             "prepare_tokens", "load_tokens", "TOKEN_DTYPES", "token_file_dtype", "RandomBatches", "eval_batches",
             "synthetic_tokens"),
    "device": ("PRECISION_CHOICES", "DEVICE_CHOICES", "mps_available", "select_device", "autocast_dtype",
               "autocast_context", "needs_grad_scaler"),
    "metrics": ("METRICS_FILE", "WANDB_REQUIREMENT", "MetricsLogger", "read_metrics"),
    "model": ("ATTENTION_IMPLS", "GPTConfig", "PRESETS", "RMSNorm", "rotate_half", "apply_rotary_pos_emb",
              "RotaryEmbedding", "MLP", "causal_attention", "CausalSelfAttention", "Block", "next_token_loss",
              "GPT"),
    "optim": ("param_groups", "configure_optimizer", "get_lr", "make_scheduler"),
    "steps": ("accumulate_gradients", "clip_gradients", "train_step", "evaluate"),
    "tokenizer": ("BPETokenizer", "train_bpe", "token_dtype", "load_tokenizer", "shard_text_files",
                  "course_corpus_path"),
})

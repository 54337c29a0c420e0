"""Checkpoints that survive a crash: atomic single-process files, ranked shards with a manifest,
FSDP full and DCP checkpoints.

    from course_lib.checkpoint import save_checkpoint, save_ranked_checkpoint
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "atomic": ("FORMAT_VERSION", "LATEST", "unwrap_model", "get_rng_state", "set_rng_state", "atomic_write",
               "save_checkpoint", "load_checkpoint", "checkpoint_path", "list_checkpoints", "latest_checkpoint",
               "resolve_resume", "save_training_checkpoint", "remove_partial_files", "clear_checkpoints",
               "move_earlier_run"),
    "fsdp": ("FULL_ON_RANK0", "MODEL_CONFIG", "gather_full_state_dict", "gather_full_optimizer_state",
             "save_full_checkpoint", "load_full_checkpoint", "save_sharded_checkpoint", "load_sharded_checkpoint"),
    "ranked": ("MANIFEST", "shard_file", "shard_bounds", "save_ranked_checkpoint", "read_manifest",
               "load_full_parameters", "load_ranked_checkpoint"),
    "workers": ("barrier_race", "load_ranked_here", "refuse_then_reshard", "train_logged", "SAVE_STEP",
                "SHARD_HEADER_BYTES", "check_ranked_save", "saved_model"),
})

"""Data parallelism: from scratch (naive, then bucketed with overlap), torch DDP, which samples each
rank sees, data loading at scale.

    from course_lib.data_parallel import BucketedDataParallel
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "collectives": ("ring_all_reduce", "slowest", "rank_tag", "mean_over_ranks", "gather_to_rank0", "shard_numel",
                    "all_gather_single", "reduce_scatter_single"),
    "collective_gate": ("Call", "process_group_calls"),
    "experiment_workers": ("bucket_sweep", "data_per_rank", "ddp_step_breakdown", "parity_and_ring",
                           "scaling_sweep", "world_size_sweep"),
    "loading": ("SHARD_INDEX", "DELAY_KINDS", "shard_name", "TokenWindowDataset", "write_token_shards",
                "read_shard_index", "rank_shards", "rank_dataset", "make_loader", "PipelineTiming",
                "time_input_pipeline", "make_train_step", "compare_workers", "ensure_shards"),
    "sampler": ("shard_indices",),
    "ddp": ("broadcast_parameters", "allreduce_gradients", "assign_buckets", "Bucket", "BucketedDataParallel"),
    "torch_ddp": ("apply_ddp", "TokenWindows", "recording_allreduce_hook", "ddp_train", "no_sync_accumulation",
                  "train_and_accumulate"),
    "workers": ("GRADIENT_SYNCS", "check_gradient_averaging", "check_train_step", "gradient_averaging_reference",
                "train_steps_one_process", "RING_SHAPES", "check_gradient_sync", "check_ring_all_reduce",
                "expected_bucket_sizes", "sync_reference"),
})

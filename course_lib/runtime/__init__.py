"""Ranks and how they start: the rank environment, the launcher, spawnable notebook functions,
collectives, cluster variables, demos.

    from course_lib.runtime import get_dist_info, spawnable
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cluster": ("DEFAULT_PORT_BASE", "node_rank_range", "expand_nodelist", "expand_tasks_per_node",
                "slurm_to_torch_env"),
    "collectives": ("ring_all_reduce", "slowest", "rank_tag", "mean_over_ranks", "gather_to_rank0", "shard_numel",
                    "all_gather_single", "reduce_scatter_single"),
    "demo_workers": ("all_reduce_steps", "collectives_demo", "whoami"),
    "env": ("DEFAULT_TIMEOUT_S", "LOG_FORMAT", "DistInfo", "default_backend", "rank_device", "get_dist_info",
            "init_distributed", "cleanup", "print0", "setup_rank_logging", "free_port"),
    "exercise_workers": ("check_distributed_eval", "check_join_job", "eval_reference"),
    "launch": ("STOP_GRACE_S", "RankFailure", "run_each"),
    "spawn": ("SPAWNABLE_IMPORTS", "spawnable", "single_process_group", "call"),
})

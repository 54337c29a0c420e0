"""Ranks and how they start: the rank environment, the launcher, spawnable notebook functions, demos of ranks
and collectives, and the check that collectives get tensors on the rank's device.

    from course_lib.runtime import get_dist_info, spawnable
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "demo_workers": ("all_reduce_steps", "collectives_demo", "whoami"),
    "env": ("DEFAULT_TIMEOUT_S", "LOG_FORMAT", "DistInfo", "default_backend", "rank_device", "get_dist_info",
            "init_distributed", "cleanup", "print0", "setup_rank_logging", "free_port"),
    "launch": ("STOP_GRACE_S", "RankFailure", "run_each"),
    "spawn": ("SPAWNABLE_IMPORTS", "spawnable", "single_process_group", "call"),
})

"""Jobs on a cluster: the SLURM variables each rank turns into torch's, several nodes on one machine, elastic
restarts, and the checks of Session C's cluster exercises.

    from course_lib.cluster import slurm_to_torch_env
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "slurm": ("DEFAULT_PORT_BASE", "node_rank_range", "expand_nodelist", "expand_tasks_per_node",
              "slurm_to_torch_env"),
    "workers": ("check_distributed_eval", "check_join_job", "eval_reference"),
})

"""Expert parallelism: a mixture-of-experts layer, its router and capacity, and the all-to-all dispatch.

    from course_lib.expert_parallel import MoE, ExpertParallelMoE
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "moe": ("Expert", "capacity", "route", "load_balancing_loss", "MoE", "all_to_all", "ExpertParallelMoE"),
    "workers": ("MOE_SHAPE", "moe_inputs", "moe_reference", "moe_run"),
    "exercise_workers": ("check_expert_parallel", "route_reference", "routing_of"),
})

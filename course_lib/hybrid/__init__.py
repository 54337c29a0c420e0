"""Parallelisms combined: data x tensor parallel on one mesh, the rank groups of 3D layouts, and a
planner for ~1000 GPUs.

    from course_lib.hybrid import rank_groups, plan
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "four_d": ("FOUR_D_SHAPE", "MoEBlock", "four_d_inputs", "four_d_place", "four_d_groups", "four_d_reference",
               "four_d_run"),
    "dp_tp": ("DATA_PARALLEL", "tp_collective_counts", "dp_tp_run", "check_parity"),
    "layout": ("DIMS", "DEFAULT_ORDER", "RankPlace", "parallel_sizes", "mesh_shape", "strides", "coordinates",
               "rank_of", "rank_groups", "all_groups", "node_of", "nodes_spanned", "check_tp_within_nodes",
               "format_layout", "torch_mesh_groups"),
    "planner": ("ACT_BYTES", "ModelShape", "MODELS", "Cluster", "H100_CLUSTER", "Layout", "check_layout",
                "pipeline_bubble", "tp_bytes_per_gpu", "pp_bytes_per_gpu", "stage_params", "Plan", "plan",
                "candidate_layouts", "best", "plan_table", "describe", "cp_bytes_per_gpu", "check_sequence",
                "PLAN_ORDER", "MOE_MODELS", "stage_expert_params", "ep_bytes_per_gpu"),
})

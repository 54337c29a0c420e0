"""Figures: loss curves, memory bars, pipeline timelines, parallelism and cluster diagrams drawn from the formulas
they show.

    from course_lib.viz import plot_loss_curves
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "diagrams": ("nccl_btree_parent", "double_binary_tree", "ring_vs_tree", "slurm_lifecycle", "node_topology",
                 "zero_memory", "cuda_stack", "checkpoint_interval", "FIGURES", "DPI", "save_all"),
    "plots": ("LAYER_COLORS", "SERIES_NAMES", "PAGE_WIDTH_IN", "plot_loss_curves", "plot_memory_bars",
              "plot_parallelism", "plot_weight_histograms", "plot_bar_table", "plot_pipeline_timelines"),
})

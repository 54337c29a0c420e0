"""Figures: loss curves, memory bars, parallelism and cluster diagrams drawn from the formulas they show.

Each module is one concept; the public names below are importable from the package itself, e.g.
`from course_lib.viz import ...`. Rank workers (`*workers.py`) are imported by their module path.
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "diagrams": ("nccl_btree_parent", "double_binary_tree", "ring_vs_tree", "slurm_lifecycle", "node_topology",
                 "zero_memory", "cuda_stack", "checkpoint_interval", "FIGURES", "DPI", "save_all"),
    "plots": ("LAYER_COLORS", "SERIES_NAMES", "plot_loss_curves", "plot_memory_bars", "plot_parallelism",
              "plot_weight_histograms", "plot_bar_table"),
})

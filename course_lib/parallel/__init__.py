"""One road through every layout: `Layout` says what the ranks do, `parallelize` applies it, train_step runs it.

    from course_lib.parallel import Layout, build_mesh, parallelize
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "layout": ("Layout", "ZERO_STAGES", "DDP_IMPLEMENTATIONS", "MESH_DIMS", "build_mesh"),
    "compose": ("Parallelized", "parallelize"),
})

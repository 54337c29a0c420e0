"""Diagrams of the GPU-cluster chapters, drawn from code so that they stay true to the formulas they show.

Each function returns a matplotlib Figure; FIGURES maps a file name to its function. The book shows the PNGs
that scripts/make_figures.py writes into book/_static/figures/ (and tests check that they are up to date):

    .venv/bin/python scripts/make_figures.py
    .venv/bin/python -m course_lib.viz.diagrams --out-dir /tmp/figures    # the same figures, anywhere

Numbers in the figures come from course_lib.memory.formulas (ZeRO memory, checkpoint waste) or from the step counts of
the algorithms; none is a measurement of a machine.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

if __name__ == "__main__":
    matplotlib.use("Agg")  # the command line has no display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from course_lib.memory.accounting import GPU_80GB
from course_lib.memory.calculator import memory_calculator_figure
from course_lib.memory.formulas import ZERO_STAGES, expected_waste, young_interval, zero_memory_per_gpu

BLUE, GREEN, RED, PURPLE, ORANGE, GREY = "#4C72B0", "#55A868", "#C44E52", "#8172B2", "#DD8452", "#8C8C8C"


def _box(ax, x, y, w, h, text="", color=BLUE, fontsize=8, text_color="white", alpha=1.0):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=color,
                                edgecolor="black", linewidth=0.8, alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, start, end, color="black", style="-|>", linestyle="-", rad=0.0, lw=1.2):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=11, color=color, linewidth=lw,
                                 linestyle=linestyle, connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))


def _canvas(ax, xlim, ylim):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")


def nccl_btree_parent(role: int, n_ranks: int) -> int | None:
    """Parent of `role` in NCCL's binary tree over n_ranks (src/graph/trees.cc): 0 is the root; leaves are odd.

    With b the lowest set bit of role: ...11[0] -> ...10[0] (role - b); ...01[0] -> ...10[0] (role + b), or
    ...00[0] (role - b) when role + b is not a rank.
    """
    if role == 0:
        return None
    bit = role & -role
    if role & (bit << 1) or role + bit >= n_ranks:
        return role - bit
    return role + bit


def double_binary_tree(n_ranks: int) -> tuple[dict, dict]:
    """({rank: parent} of tree 1, {rank: parent} of tree 2), as NCCL builds them: for even n_ranks tree 2 is tree 1
    shifted by one rank, so every rank that is a leaf in one tree is an inner node of the other; for odd n_ranks
    it is mirrored."""
    tree1 = {r: nccl_btree_parent(r, n_ranks) for r in range(n_ranks)}
    role = (lambda r: (r - 1) % n_ranks) if n_ranks % 2 == 0 else (lambda r: n_ranks - 1 - r)
    rank_of = {role(r): r for r in range(n_ranks)}
    tree2 = {}
    for r in range(n_ranks):
        parent_role = nccl_btree_parent(role(r), n_ranks)
        tree2[r] = None if parent_role is None else rank_of[parent_role]
    return tree1, tree2


def _depth(parents: dict, node: int) -> int:
    depth = 0
    while parents[node] is not None:
        node, depth = parents[node], depth + 1
    return depth


def ring_vs_tree(n_ranks: int = 8, max_ranks: int = 1024) -> Figure:
    """The ring, NCCL's two complementary binary trees, and the sequential steps each needs as ranks grow."""
    if not 4 <= n_ranks <= 16 or n_ranks % 2:
        raise ValueError(f"n_ranks must be even and between 4 and 16 to draw legibly, got {n_ranks}")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), layout="constrained", width_ratios=(1, 1.5, 1.1))
    ax = axes[0]
    angles = [math.pi / 2 - 2 * math.pi * r / n_ranks for r in range(n_ranks)]
    points = [(math.cos(a), math.sin(a)) for a in angles]
    step = 2 * math.pi / n_ranks
    for r, (x, y) in enumerate(points):
        start = (math.cos(angles[r] - 0.22 * step), math.sin(angles[r] - 0.22 * step))
        end = (math.cos(angles[r] - 0.78 * step), math.sin(angles[r] - 0.78 * step))
        _arrow(ax, start, end, color=BLUE, rad=-0.1)
        ax.add_patch(plt.Circle((x, y), 0.16, facecolor=BLUE, edgecolor="black", zorder=3))
        ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=9, zorder=4)
    ax.text(0, 0, "ring\n2(n-1) steps,\neach sends S/n", ha="center", va="center", fontsize=9)
    _canvas(ax, (-1.3, 1.3), (-1.3, 1.3))
    ax.set_title(f"Ring all-reduce, n = {n_ranks}", fontsize=11)

    ax = axes[1]
    role = (lambda r: (r - 1) % n_ranks) if n_ranks % 2 == 0 else (lambda r: n_ranks - 1 - r)
    for tree, (parents, color, place, y0) in enumerate(zip(double_binary_tree(n_ranks), (BLUE, ORANGE),
                                                           (lambda r: r, role), (0.0, -4.4))):
        position = {r: (place(r), y0 - 0.9 * _depth(parents, r)) for r in parents}
        for child, parent in parents.items():
            if parent is not None:
                ax.plot(*zip(position[parent], position[child]), color=color, linewidth=1.5, zorder=1)
        for r, (x, y) in position.items():
            ax.add_patch(plt.Circle((x, y), 0.32, facecolor=color, edgecolor="black", zorder=3))
            ax.text(x, y, str(r), ha="center", va="center", color="white", fontsize=9, zorder=4)
        ax.text(-1.0, y0, f"tree {tree + 1}", ha="right", va="center", fontsize=9, color=color, weight="bold")
    ax.text(n_ranks / 2 - 0.5, -8.6, "each tree carries half of the data; a rank that is a leaf in one tree is\n"
            "an inner node of the other, so every rank sends and receives in both halves", ha="center", fontsize=8)
    _canvas(ax, (-2.4, n_ranks + 0.2), (-9.2, 0.6))
    ax.set_title("NCCL's double binary tree: about 2 log2(n) steps", fontsize=11)

    ax = axes[2]
    ns = [2**k for k in range(1, int(math.log2(max_ranks)) + 1)]
    ax.loglog(ns, [2 * (n - 1) for n in ns], "o-", color=BLUE, label="ring: 2(n - 1)", base=2)
    ax.loglog(ns, [2 * math.ceil(math.log2(n)) for n in ns], "s-", color=ORANGE, label="tree: 2 log2(n)", base=2)
    ax.set_xlabel("ranks n")
    ax.set_ylabel("sequential steps (latency terms)")
    ax.set_title("Why small messages at scale use trees", fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    return fig


def slurm_lifecycle() -> Figure:
    """The states a SLURM batch job goes through, with the commands and signals that move it."""
    fig, ax = plt.subplots(figsize=(13, 5.4), layout="constrained")
    main = [("sbatch job.sbatch", "queued; the job id\nis printed", GREY), ("PENDING", "waits for priority and\n"
            "free nodes (squeue: REASON)", ORANGE), ("CONFIGURING", "nodes allocated,\nprolog runs", PURPLE),
            ("RUNNING", "the batch script runs;\nsrun starts the ranks", GREEN),
            ("COMPLETING", "epilog runs,\nnodes are released", PURPLE)]
    w, h, y, pitch = 2.2, 1.3, 2.9, 2.6
    for i, (state, note, color) in enumerate(main):
        _box(ax, i * pitch, y, w, h, color=color)
        ax.text(i * pitch + w / 2, y + h - 0.35, state, ha="center", va="center", fontsize=10, color="white",
                weight="bold")
        ax.text(i * pitch + w / 2, y + 0.4, note, ha="center", va="center", fontsize=8, color="white")
        if i:
            _arrow(ax, ((i - 1) * pitch + w, y + h / 2), (i * pitch, y + h / 2))
    _arrow(ax, (3 * pitch + w / 2, y + h), (pitch + w / 2, y + h), color=ORANGE, linestyle="--", rad=0.3)
    ax.text(2 * pitch + w / 2, y + h + 1.05, "PREEMPTED, or scontrol requeue (with --requeue): back to the queue;\n"
            "the job must resume from its last checkpoint", ha="center", va="bottom", fontsize=8, color=ORANGE)
    ends = [("COMPLETED\nexit code 0", GREEN), ("FAILED\nexit code != 0", RED), ("TIMEOUT\n--time reached", RED),
            ("CANCELLED\nscancel", GREY), ("OUT_OF_MEMORY\nhost RAM limit", RED), ("NODE_FAIL\nhardware", RED)]
    for i, (text, color) in enumerate(ends):
        x = 0.3 + i * 2.1
        _box(ax, x, 0.55, 1.9, 0.9, text, color, fontsize=8)
        _arrow(ax, (4 * pitch + w / 2, y), (x + 0.95, 1.45), color=GREY, lw=0.8)
    ax.text(6.3, 0.2, "At the time limit SLURM sends SIGTERM, waits KillWait (30 s by default), then SIGKILL; "
            "#SBATCH --signal=USR1@120 adds a warning signal 120 s before (the course CLI then checkpoints).", ha="center", va="center",
            fontsize=8, color=RED)
    _canvas(ax, (-0.2, 13.0), (-0.1, 6.0))
    ax.set_title("Life of a SLURM batch job (sacct -j <id> shows its state and exit code)", fontsize=11)
    return fig


def node_topology(n_nodes: int = 2, gpus_per_node: int = 8) -> Figure:
    """Nodes of GPUs joined by NVLink/NVSwitch inside a node and by one network card per GPU between nodes.

    The nodes are drawn one above the other, facing the network switches between them, so that eight GPUs
    per node stay readable at the width of a book page.
    """
    if not 1 <= n_nodes <= 2 or gpus_per_node not in (4, 8):
        raise ValueError(f"draws 1 or 2 nodes of 4 or 8 GPUs, got n_nodes={n_nodes}, gpus_per_node={gpus_per_node}")
    gpu_w, gpu_gap = 0.72, 0.12
    node_w = gpus_per_node * (gpu_w + gpu_gap) + 0.3
    switch_h = 0.45
    top, bottom = 3.75, -3.75 if n_nodes == 2 else -switch_h / 2
    fig, ax = plt.subplots(figsize=(1.0 + 0.95 * node_w, 0.9 + 0.95 * (top - bottom + 1.0)), layout="constrained")

    def span(d, near, far):  # a (y, height) band at distances near..far from the switch, on side d (+1 up, -1 down)
        return (near, far - near) if d > 0 else (-far, far - near)

    for node in range(n_nodes):
        d = 1 if node == 0 else -1
        y, h = span(d, 0.7, 3.75)
        _box(ax, 0, y, node_w, h, color="#F2F2F2")
        ax.text(0.1, d * 3.55, f"node {node}", fontsize=10, weight="bold", va="center")
        y, h = span(d, 2.75, 3.2)
        _box(ax, 0.15, y, node_w - 0.3, h, "NVSwitch: every GPU to every GPU over NVLink", GREEN, 9)
        for g in range(gpus_per_node):
            x = 0.15 + g * (gpu_w + gpu_gap) + gpu_gap / 2
            y, h = span(d, 1.8, 2.45)
            _box(ax, x, y, gpu_w, h, f"GPU {g}\nrank {node * gpus_per_node + g}", BLUE, 8)
            y, h = span(d, 0.9, 1.3)
            _box(ax, x + 0.06, y, gpu_w - 0.12, h, "NIC", PURPLE, 8)
            center = x + gpu_w / 2
            ax.plot([center, center], [d * 2.45, d * 2.75], color=GREEN, linewidth=2.5)        # NVLink
            ax.plot([center, center], [d * 1.3, d * 1.8], color=GREY, linewidth=1.5)          # PCIe
            ax.plot([center, center], [d * switch_h / 2, d * 0.9], color=PURPLE, linewidth=1.0)  # cable
    _box(ax, 0, -switch_h / 2, node_w, switch_h, "network switches (InfiniBand or RoCE): the only path between "
         "nodes", PURPLE, 9)
    ax.text(node_w / 2, top + 0.15, "green: NVLink (inside a node, fastest)   grey: PCIe (GPU to NIC; GPUDirect RDMA\n"
            "lets the NIC read GPU memory)   purple: network, one NIC per GPU (a 'rail')", ha="center", va="bottom",
            fontsize=9)
    _canvas(ax, (-0.1, node_w + 0.1), (bottom - 0.1, top + 0.9))
    ax.set_title("Where the bytes travel: NCCL builds its rings and trees on this topology", fontsize=11)
    return fig


def zero_memory(n_params: float = 7.5e9, world_sizes=(8, 64), device_bytes: int = GPU_80GB) -> Figure:
    """Stacked bars of model-state bytes per GPU for ZeRO stages 0-3 at several data-parallel sizes."""
    fig, ax = plt.subplots(figsize=(10, 4.6), layout="constrained")
    kinds = (("params", "fp16/bf16 parameters", BLUE), ("grads", "fp16/bf16 gradients", GREEN),
             ("optimizer_states", "optimizer states (fp32 master, m, v)", ORANGE))
    width, labels, centers = 0.8, [], []
    for group, n_gpus in enumerate(world_sizes):
        for stage in ZERO_STAGES:
            x = group * (len(ZERO_STAGES) + 1) + stage
            memory = zero_memory_per_gpu(n_params, n_gpus, stage)
            bottom = 0.0
            for key, label, color in kinds:
                value = getattr(memory, key) / 1e9
                ax.bar(x, value, width, bottom=bottom, color=color, edgecolor="black", linewidth=0.5,
                       label=label if group == stage == 0 else None)
                bottom += value
            ax.text(x, bottom + 1.5, f"{bottom:.3g}", ha="center", fontsize=8)
            centers.append(x)
            labels.append(f"stage {stage}\nN_d={n_gpus}")
    ax.axhline(device_bytes / 1e9, color=RED, linestyle="--", linewidth=1)
    ax.text(centers[-1] + 0.5, device_bytes / 1e9 + 1.5, f"{device_bytes / 1e9:.0f} GB GPU", color=RED,
            ha="right", fontsize=8)
    ax.set_xticks(centers, labels, fontsize=8)
    ax.set_ylabel("GB per GPU (model states only)")
    ax.set_title(f"ZeRO: model states of a {n_params / 1e9:g}B-parameter model per GPU, mixed-precision Adam",
                 fontsize=11)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def cuda_stack() -> Figure:
    """What lives on the host and what ships in the container: driver below, CUDA runtime and libraries above."""
    fig, ax = plt.subplots(figsize=(10, 5.6), layout="constrained")
    layers = [(0.2, "GPU hardware (compute capability: 8.0 A100, 9.0 H100, ...)", GREY),
              (1.0, "kernel driver nvidia.ko (installed on the host by the administrators)", PURPLE),
              (1.8, "user-mode driver libcuda.so + NVML libnvidia-ml.so (host; mounted into the container)", PURPLE),
              (2.9, "CUDA runtime libcudart, cuBLAS, cuDNN, NCCL (shipped in the torch wheel or image)", BLUE),
              (3.7, "PyTorch (torch.version.cuda = the runtime it was built with)", BLUE),
              (4.5, "course_lib and your training script", GREEN)]
    for y, text, color in layers:
        _box(ax, 0.3, y, 8.0, 0.6, text, color, fontsize=9)
    ax.plot([0.1, 8.5], [2.6, 2.6], color="black", linestyle=":", linewidth=1)
    ax.text(8.6, 1.3, "host", fontsize=10, va="center", weight="bold")
    ax.text(8.6, 3.9, "container\nimage", fontsize=10, va="center", weight="bold")
    ax.text(4.3, 2.62, "the driver must support the runtime: driver's CUDA version (nvidia-smi) "
            ">= torch.version.cuda, or the same major version (minor-version compatibility)",
            ha="center", va="bottom", fontsize=8, color=RED)
    _canvas(ax, (0, 10), (0, 5.3))
    ax.set_title("Driver vs runtime vs container: who provides what", fontsize=11)
    return fig


def checkpoint_interval(checkpoint_s: float = 20.0, mtbf_hours: float = 12.0, restart_min: float = 10.0) -> Figure:
    """Fraction of wall time lost vs checkpoint interval, with Young's optimum sqrt(2 delta M) marked."""
    mtbf_s, restart_s = mtbf_hours * 3600, restart_min * 60
    fig, ax = plt.subplots(figsize=(8, 4.2), layout="constrained")
    minutes = [m / 2 for m in range(2, 2 * 180)]
    waste = [expected_waste(m * 60, checkpoint_s, mtbf_s, restart_s) for m in minutes]
    ax.plot(minutes, [100 * w for w in waste], color=BLUE, label="total waste")
    ax.plot(minutes, [100 * checkpoint_s / (m * 60) for m in minutes], "--", color=GREEN, label="writing checkpoints")
    ax.plot(minutes, [100 * m * 60 / (2 * mtbf_s) for m in minutes], "--", color=ORANGE,
            label="recomputing lost work")
    ax.axhline(100 * restart_s / mtbf_s, color=PURPLE, linestyle="--", label="restarting")
    best = young_interval(checkpoint_s, mtbf_s) / 60
    ax.axvline(best, color=RED, linestyle=":", linewidth=1)
    ax.text(best, 12, f" Young: sqrt(2 delta M) = {best:.0f} min", color=RED, fontsize=8)
    ax.set_ylim(0, 25)
    ax.set_xlabel("checkpoint interval (minutes)")
    ax.set_ylabel("% of wall time lost")
    ax.set_title(f"Checkpoint write {checkpoint_s:g} s, job MTBF {mtbf_hours:g} h, restart {restart_min:g} min",
                 fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


FIGURES = {"ring_vs_tree.png": ring_vs_tree, "slurm_lifecycle.png": slurm_lifecycle,
           "node_topology.png": node_topology, "zero_memory.png": zero_memory, "cuda_stack.png": cuda_stack,
           "checkpoint_interval.png": checkpoint_interval, "memory_calculator.png": memory_calculator_figure}
DPI = 110


def save_all(out_dir) -> list[Path]:
    """Draw every figure of FIGURES into out_dir as PNG, deterministically (default style, no metadata)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context(matplotlib.rcParamsDefault):
        for name, draw in FIGURES.items():
            fig = draw()
            fig.savefig(out / name, dpi=DPI, metadata={"Software": None})
            plt.close(fig)
            written.append(out / name)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="figures")
    args = parser.parse_args(argv)
    for path in save_all(args.out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

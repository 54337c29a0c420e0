"""Figures for the notebooks: loss curves, memory bars, a parallelism diagram, weight histograms, pipeline timelines.

Every function draws with matplotlib's object API and returns the Figure, so a notebook shows it and a
test counts its lines and bars; none calls plt.show(). Loss curves read the records that
course_lib.core.metrics writes (one dict per step: {"step": ..., "loss": ...}, and {"step": ..., "val_loss": ...}
at evaluations), so a run's metrics.jsonl plots directly.

Draw the diagram and the memory bars into PNG files:

    python -m course_lib.viz.plots --out-dir /tmp/figures
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

if __name__ == "__main__":
    matplotlib.use("Agg")  # the command line has no display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from course_lib.core.model import PRESETS
from course_lib.memory.accounting import (
    GPU_80GB,
    MemoryEstimate,
    count_parameters,
    estimate_training_memory,
    format_bytes,
)
from course_lib.observability.timeline import COLORS, plot_timelines
from course_lib.pipeline_parallel.schedules import with_idle

LAYER_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2")
SERIES_NAMES = {"loss": "train", "val_loss": "validation"}  # legend names of the metrics keys
PAGE_WIDTH_IN = 8.0
"""Width of a figure drawn for the book's page: 800 px at the 100 dpi of Jupyter's inline backend, shown at the
page's content width (about 700 px) without shrinking its 10-point labels below 10 px."""
PIPELINE_LABEL_PT = 8  # micro-batch numbers on the bars: 11 px at 100 dpi


def _new_axes(ax, figsize=(7, 4)):
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return fig, ax


def _series(records, key: str, x: str = "step") -> tuple[list, list]:
    """(xs, ys) of the records that have `key` (train and eval records interleave in one file)."""
    if records and not isinstance(records[0], Mapping):  # a bare list of numbers: train losses, x is their index
        if key.startswith("val"):
            return [], []
        return list(range(len(records))), [float(v) for v in records]
    points = [(r[x], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _running_mean(xs: list, ys: list, window: int) -> tuple[list, list]:
    if window <= 1 or len(ys) < window:
        return xs, ys
    means = np.convolve(np.asarray(ys, dtype=float), np.ones(window) / window, mode="valid")
    return xs[window - 1:], means.tolist()  # each mean is plotted at the last step it covers


def plot_loss_curves(runs: Mapping[str, Sequence], *, keys: Sequence[str] = ("loss", "val_loss"), x: str = "step",
                     smooth: int = 1, ylabel: str = "loss (nats / token)", title: str | None = None,
                     logy: bool = False, ax=None) -> Figure:
    """One line per (run, key) that has data: each run gets a colour, train loss solid, val loss dashed + dots.

    runs: {label: records}, records a list of metric dicts (read_metrics output) or a plain list of losses.
    smooth: running mean over this many points for the per-step keys (not for val_* keys, which are sparse).
    A run with no value for a key gets no line for it, so the figure has exactly as many lines as series.
    Legend: one run names its lines by key ("train", "validation"); several runs get one entry each (the
    first line drawn for the run) and the legend title says which line style is which key.
    """
    if not runs:
        raise ValueError("runs is empty: pass {label: records} with at least one run")
    fig, ax = _new_axes(ax)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn, styles = 0, {}
    for i, (label, records) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        named = False
        for key in keys:
            xs, ys = _series(records, key, x)
            if not xs:
                continue
            val = key.startswith("val")
            if not val:
                xs, ys = _running_mean(xs, ys, smooth)
            series = SERIES_NAMES.get(key, key)
            styles[series] = "dashed + dots" if val else "solid"
            if len(runs) == 1:
                name = series if len(keys) > 1 else label
            else:
                name, named = ("_nolegend_" if named else label), True
            ax.plot(xs, ys, color=color, linestyle="--" if val else "-", marker="o" if val else None,
                    markersize=4, alpha=1.0 if val else 0.8, label=name)
            drawn += 1
    if drawn == 0:
        raise ValueError(f"none of the runs has values for the keys {list(keys)}")
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel + (f", running mean of {smooth}" if smooth > 1 else ""))
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    legend_title = ", ".join(f"{style}: {series}" for series, style in styles.items())
    ax.legend(fontsize=8, title=legend_title if len(runs) > 1 and len(styles) > 1 else None, title_fontsize=8)
    if title:
        ax.set_title(title)
    return fig


def plot_memory_bars(models: Mapping[str, MemoryEstimate | int], *, device_bytes: int = GPU_80GB,
                     precision: str = "mixed", optimizer: str = "adamw", ax=None) -> Figure:
    """One bar per model: bytes of weights + gradients + optimizer states, log scale, a line at one GPU.

    models: {name: MemoryEstimate} or {name: parameter count} (estimated with `precision` and `optimizer`).
    """
    if not models:
        raise ValueError("models is empty")
    estimates = {name: m if isinstance(m, MemoryEstimate) else
                 estimate_training_memory(m, precision=precision, optimizer=optimizer) for name, m in models.items()}
    fig, ax = _new_axes(ax)
    names = list(estimates)
    totals = [estimates[n].total for n in names]
    colors = ["#C44E52" if t > device_bytes else "#4C72B0" for t in totals]
    bars = ax.bar(names, totals, color=colors)
    for bar, total in zip(bars, totals):
        ax.annotate(format_bytes(total), (bar.get_x() + bar.get_width() / 2, total), ha="center", va="bottom",
                    fontsize=9, xytext=(0, 2), textcoords="offset points")
    ax.axhline(device_bytes, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"one {format_bytes(device_bytes)} GPU", (0, device_bytes), xytext=(0, 4),
                textcoords="offset points", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylim(min(totals) / 3, max(max(totals), device_bytes) * 5)
    ax.set_ylabel("bytes (log scale)")
    ax.set_title("Weights + gradients + optimizer states (activations come on top)")
    return fig


def _box(ax, x, y, w, h, color, text="", fontsize=8, alpha=1.0, text_color="white"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.8, alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, start, end, text="", color="black", both_ways=True):
    """An arrow from start to end (both ways: an exchange), with text above its middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both_ways else "-|>",
                                 mutation_scale=10, color=color, linewidth=1.2))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.25, text, ha="center",
                va="bottom", fontsize=8, color=color)


def plot_parallelism(n_layers: int = 4) -> Figure:
    """Data, model (tensor) and pipeline parallelism on two devices, for a model of n_layers layers.

    Each panel shows what each device holds (coloured layers, or halves of layers) and what the devices
    exchange (arrows): gradients for data parallel, partial activations inside every layer for tensor
    parallel, activations between stages for pipeline parallel.
    """
    if not 2 <= n_layers <= len(LAYER_COLORS) or n_layers % 2:
        raise ValueError(f"n_layers must be 2 or 4 (an even count the two pipeline stages split), got {n_layers}")
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2), layout="constrained")
    layer_h, gap, dev_w, dev_gap = 0.7, 0.15, 3.0, 2.0
    stack_h = n_layers * (layer_h + gap)
    titles = ("Data parallel", "Model (tensor) parallel", "Pipeline parallel")
    notes = ("each device: the whole model,\nits own slice of the batch",
             "each device: half of every layer,\nthe same batch",
             "each device: some of the layers,\nmicro-batches flow through")
    for panel, ax in enumerate(axes):
        for dev in range(2):
            x0 = 0.3 + dev * (dev_w + dev_gap)
            _box(ax, x0 - 0.15, 0.6, dev_w + 0.3, stack_h + 0.6, "#EEEEEE", alpha=1.0)
            ax.text(x0 + dev_w / 2, stack_h + 1.35, f"device {dev}", ha="center", fontsize=9, weight="bold")
            for layer in range(n_layers):
                y = 0.9 + layer * (layer_h + gap)
                color = LAYER_COLORS[layer]
                if panel == 0:
                    _box(ax, x0, y, dev_w, layer_h, color, f"layer {layer}")
                elif panel == 1:
                    _box(ax, x0, y, dev_w, layer_h, color, "", alpha=0.15)
                    half = dev_w / 2
                    _box(ax, x0 + dev * half, y, half, layer_h, color, f"layer {layer}\nhalf {dev}", fontsize=7)
                else:
                    mine = layer // (n_layers // 2) == dev
                    if mine:
                        _box(ax, x0, y, dev_w, layer_h, color, f"layer {layer}")
            label = {0: f"batch shard {dev}", 1: "full batch", 2: "micro-batches" if dev == 0 else "from device 0"}
            ax.text(x0 + dev_w / 2, 0.25, label[panel], ha="center", fontsize=8, style="italic")
        left, right = 0.3 + dev_w + 0.2, 0.3 + dev_w + dev_gap - 0.2
        mid = 0.6 + stack_h / 2
        if panel == 0:
            _arrow(ax, (left, mid), (right, mid), "all-reduce\ngradients", "#C44E52")
        elif panel == 1:
            for layer in range(n_layers):
                y = 0.9 + layer * (layer_h + gap) + layer_h / 2
                _arrow(ax, (left, y), (right, y), "", "#C44E52")
            ax.text((left + right) / 2, 0.25, "combine\nactivations\nin every layer", ha="center",
                    fontsize=7, color="#C44E52")
        else:
            top_stage0 = 0.9 + (n_layers // 2 - 1) * (layer_h + gap) + layer_h
            _arrow(ax, (left, top_stage0), (right, 0.9 + (n_layers // 2) * (layer_h + gap)),
                   "activations", "#C44E52", both_ways=False)
        ax.set_xlim(0, 2 * dev_w + dev_gap + 0.6)
        ax.set_ylim(0, stack_h + 1.8)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{titles[panel]}\n", fontsize=11)
        ax.text(0.5, -0.02, notes[panel], transform=ax.transAxes, ha="center", va="top", fontsize=8)
    return fig


def plot_weight_histograms(state_dicts: Mapping[str, Mapping], name: str, *, bins: int = 60, ax=None) -> Figure:
    """Histogram of one weight tensor in several checkpoints (one outline per checkpoint), shared bins.

    state_dicts: {label: model state_dict}, e.g. {"step 0": ..., "step 200": ...}; name: a key such as
    "blocks.0.mlp.up_proj.weight".
    """
    if not state_dicts:
        raise ValueError("state_dicts is empty")
    for label, sd in state_dicts.items():
        if name not in sd:
            raise KeyError(f"{name!r} is not in state_dict {label!r}; keys include {sorted(sd)[:6]}")
    values = {label: sd[name].detach().float().cpu().flatten().numpy() for label, sd in state_dicts.items()}
    low = min(v.min() for v in values.values())
    high = max(v.max() for v in values.values())
    edges = np.linspace(low, high, bins + 1)
    fig, ax = _new_axes(ax)
    for label, v in values.items():
        counts, _ = np.histogram(v, bins=edges)
        ax.stairs(counts, edges, label=f"{label} (std {v.std():.4f})", linewidth=1.5)
    ax.set_xlabel(f"value of {name}")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def plot_bar_table(labels: Sequence[str], values: Sequence[float], *, ylabel: str, title: str | None = None,
                   ax=None) -> Figure:
    """A plain bar chart (e.g. each configuration's loss minus the baseline's), values printed at the bar ends.

    Bars grow from zero in both directions (a line marks zero), so differences can be shown as they are.
    """
    if len(labels) != len(values) or not labels:
        raise ValueError(f"need one value per label, got {len(labels)} labels and {len(values)} values")
    fig, ax = _new_axes(ax)
    shown = [v if math.isfinite(v) else 0.0 for v in values]
    bars = ax.bar(list(labels), shown, color=["#C44E52" if v > 0 else "#4C72B0" for v in shown])
    for bar, value, height in zip(bars, values, shown):
        below = height < 0
        ax.annotate(f"{value:+.3f}" if math.isfinite(value) else "n/a",
                    (bar.get_x() + bar.get_width() / 2, height), ha="center", va="top" if below else "bottom",
                    fontsize=8, xytext=(0, -2 if below else 2), textcoords="offset points")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.margins(y=0.15)  # room for the labels at the bar ends
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    if title:
        ax.set_title(title)
    return fig


def plot_pipeline_timelines(panels: Mapping[str, tuple[Sequence, Sequence]], *, xlabel: str | None = None,
                            width: float = PAGE_WIDTH_IN) -> Figure:
    """Pipeline timelines at the width of a book page, one panel per schedule, one row per rank.

    panels: {title: (per_rank_intervals, per_rank_micro_batch_ids)}, as simulate_schedule returns them or as a
    pipeline run records them: every forward and backward a bar, every idle gap grey, the micro-batch number
    written on each bar wide enough to hold it. One legend for the whole figure, above the panels.
    """
    if not panels:
        raise ValueError("need at least one panel: {title: (per_rank_intervals, per_rank_ids)}")
    n_ranks = max(len(per_rank) for per_rank, _ in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, len(panels) * (0.5 * n_ranks + 1.05) + 0.45),
                             layout="constrained", squeeze=False)
    axes_px = 0.88 * width * 100  # the time axis at 100 dpi, between the rank labels and the right edge
    kinds = {}
    for ax, (title, (per_rank, ids)) in zip(axes[:, 0], panels.items()):
        drawn = with_idle(per_rank)
        plot_timelines(drawn, ax=ax, title=title)
        kinds.update((kind, COLORS.get(kind, "#999999")) for rank in drawn for kind, _, _ in rank)
        ax.get_legend().remove()
        ax.title.set_fontsize(10)
        origin = min(start for rank in per_rank for _, start, _ in rank)
        span = max(end for rank in per_rank for _, _, end in rank) - origin
        for r, (intervals, numbers) in enumerate(zip(per_rank, ids)):
            for (kind, start, end), i in zip(intervals, numbers):
                x = (start - origin) * 1e3
                ax.plot([x, x], [r - 0.35, r + 0.35], color="white", linewidth=0.8)  # where one bar meets the next
                if (end - start) / span * axes_px >= 7 * len(str(i)) + 3:  # the number fits inside its bar
                    ax.text(((start + end) / 2 - origin) * 1e3, r, str(i), ha="center", va="center",
                            fontsize=PIPELINE_LABEL_PT, color="white")
        ax.set_xlabel(xlabel or "time (ms)")
    kinds = dict(sorted(kinds.items(), key=lambda item: item[0] == "idle"))  # idle last
    fig.legend(handles=[Rectangle((0, 0), 1, 1, color=color, label=kind) for kind, color in kinds.items()],
               loc="outside upper center", ncols=len(kinds), fontsize=9, frameon=False)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description="Draw the parallelism diagram and the memory bars as PNG files.")
    parser.add_argument("--out-dir", default="figures")
    out = Path(parser.parse_args(argv).out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_parallelism().savefig(out / "parallelism.png", dpi=120)
    counts = {name: count_parameters(PRESETS[name]) for name in ("tiny", "gpt2-small")}
    counts["7B"] = 7 * 10**9
    plot_memory_bars(counts).savefig(out / "memory_bars.png", dpi=120)
    print(f"wrote {out / 'parallelism.png'} and {out / 'memory_bars.png'}")


if __name__ == "__main__":
    main()

"""Per-rank timelines: record when each rank computes and communicates, then draw them side by side.

Intervals are (kind, start, end) with time.monotonic() stamps, which share one clock across the processes of a
machine, so ranks can be drawn on a common axis.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

COLORS = {"forward": "#4C72B0", "backward": "#55A868", "sync": "#C44E52", "allreduce": "#DD8452",
          "optimizer": "#8172B3", "data": "#937860", "idle": "#DDDDDD", "send": "#DA8BC3", "recv": "#CCB974"}


class Timeline:
    """Collects (kind, start, end) intervals: `with timeline.span("forward"): ...`."""

    def __init__(self):
        self.intervals: list[tuple[str, float, float]] = []

    @contextmanager
    def span(self, kind: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.intervals.append((kind, start, time.monotonic()))


def plot_timelines(per_rank: list[list[tuple[str, float, float]]], ax=None, title: str = "Per-rank timeline",
                   lanes: dict[str, float] | None = None):
    """One row per rank; each interval a coloured bar. `lanes` offsets kinds vertically inside a row
    (e.g. {'allreduce': 0.5}) so overlapping communication shows under the compute that hides it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 * len(per_rank) + 1.2))
    lanes = lanes or {}
    origin = min(start for intervals in per_rank for _, start, _ in intervals)
    seen = {}
    for rank, intervals in enumerate(per_rank):
        for kind, start, end in intervals:
            offset = lanes.get(kind, 0.0)
            height = 0.35 if kind in lanes or lanes else 0.7
            y = rank - 0.35 + offset
            ax.broken_barh([((start - origin) * 1e3, (end - start) * 1e3)], (y, height),
                           color=COLORS.get(kind, "#999999"))
            seen[kind] = COLORS.get(kind, "#999999")
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in seen.items()], loc="upper right", fontsize=8)
    return ax

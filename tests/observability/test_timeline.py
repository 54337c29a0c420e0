import time

import matplotlib

matplotlib.use("Agg")

from course_lib.observability.timeline import Timeline, plot_timelines


def test_span_records_and_plot_draws_every_interval():
    timeline = Timeline()
    with timeline.span("forward"):
        time.sleep(0.01)
    with timeline.span("allreduce"):
        pass
    kinds = [kind for kind, _, _ in timeline.intervals]
    assert kinds == ["forward", "allreduce"]
    start, end = timeline.intervals[0][1:]
    assert end - start >= 0.009
    ax = plot_timelines([timeline.intervals, timeline.intervals], lanes={"allreduce": 0.4})
    assert len(ax.collections) == 4  # two intervals on each of two ranks
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]

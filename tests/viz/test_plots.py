"""course_lib.viz.plots: every figure function returns a Figure with the expected lines, bars and patches."""

import matplotlib

matplotlib.use("Agg")  # no display in tests

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.figure import Figure

from course_lib.memory.accounting import estimate_training_memory
from course_lib.pipeline_parallel.schedules import simulate_schedule
from course_lib.viz.plots import (
    plot_bar_table,
    plot_loss_curves,
    plot_memory_bars,
    plot_parallelism,
    plot_pipeline_timelines,
    plot_weight_histograms,
)

INLINE_DPI = 100  # Jupyter's inline backend draws at matplotlib's default dpi, with bbox_inches="tight"
PAGE_PX = (700, 850)  # a figure the book shows at its content width (~700 px) without shrinking it much
MIN_TEXT_PX = 10


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def metrics(n_steps, eval_every, offset=0.0):
    """Records shaped like metrics.jsonl: a train record per step, an eval record every eval_every steps."""
    records = []
    for step in range(1, n_steps + 1):
        records.append({"kind": "train", "step": step, "loss": 5.0 - 0.01 * step + offset})
        if step % eval_every == 0:
            records.append({"kind": "eval", "step": step, "val_loss": 5.1 - 0.01 * step + offset})
    return records


def test_loss_curves_one_line_per_run_and_key():
    fig = plot_loss_curves({"a": metrics(20, 5), "b": metrics(20, 10, offset=0.1)})
    assert isinstance(fig, Figure)
    lines = fig.axes[0].get_lines()
    assert len(lines) == 4  # 2 runs x (train, validation)
    a_train, a_val, b_train, b_val = lines
    assert list(a_val.get_xdata()) == [5, 10, 15, 20] and list(b_val.get_xdata()) == [10, 20]
    assert a_val.get_linestyle() == "--" and a_train.get_linestyle() == "-"
    assert a_train.get_color() == a_val.get_color() != b_train.get_color()
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b"]  # one entry per run
    assert legend.get_title().get_text() == "solid: train, dashed + dots: validation"


def test_loss_curves_single_run_names_its_series():
    fig = plot_loss_curves({"tiny": metrics(10, 5)}, ylabel="mse")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["train", "validation"]
    assert fig.axes[0].get_ylabel() == "mse"


def test_loss_curves_skip_keys_a_run_does_not_have():
    fig = plot_loss_curves({"no eval": [r for r in metrics(10, 5) if r["kind"] == "train"]})
    assert len(fig.axes[0].get_lines()) == 1


def test_loss_curves_from_a_plain_list_and_running_mean():
    losses = [float(v) for v in range(10)]
    fig = plot_loss_curves({"plain": losses}, keys=("loss",), smooth=4)
    (line,) = fig.axes[0].get_lines()
    # running mean over 4 points, placed at the last point each covers
    assert list(line.get_xdata()) == [3, 4, 5, 6, 7, 8, 9]
    assert list(line.get_ydata()) == pytest.approx([1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5])


def test_plain_lists_are_train_losses_drawn_once_with_the_default_keys():
    fig = plot_loss_curves({"fp32": [3.0, 2.5, 2.0], "bf16": [3.1, 2.6, 2.1]})
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2, "a plain list of losses has no validation series to draw"
    assert all(line.get_linestyle() == "-" for line in lines)


def test_loss_curves_other_x_axis_and_existing_axes():
    records = [{"step": s, "loss": 1.0 / s, "seconds": 0.5 * s} for s in range(1, 6)]
    fig, axes = plt.subplots(1, 2)
    returned = plot_loss_curves({"r": records}, keys=("loss",), x="seconds", ax=axes[1])
    assert returned is fig
    assert list(axes[1].get_lines()[0].get_xdata()) == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert not axes[0].get_lines()


def test_loss_curves_reject_empty_input():
    with pytest.raises(ValueError, match="runs is empty"):
        plot_loss_curves({})
    with pytest.raises(ValueError, match="none of the runs"):
        plot_loss_curves({"r": [{"step": 1, "other": 2.0}]})


def test_memory_bars_one_bar_per_model_log_scale_and_device_line():
    models = {"tiny": 98_624, "7B": 7 * 10**9}
    fig = plot_memory_bars(models, precision="mixed")
    ax = fig.axes[0]
    bars = ax.patches
    assert len(bars) == 2
    assert bars[1].get_height() == 16 * 7 * 10**9  # mixed-precision Adam: 16 bytes per parameter
    assert bars[0].get_height() == 16 * 98_624
    assert ax.get_yscale() == "log"
    (device_line,) = ax.get_lines()
    assert device_line.get_ydata()[0] == 80 * 10**9


def test_memory_bars_accept_estimates():
    estimate = estimate_training_memory(1000, precision="fp32", optimizer="sgd")
    fig = plot_memory_bars({"sgd": estimate, "adam": 1000})
    assert [b.get_height() for b in fig.axes[0].patches] == [8000, 16000]


def test_parallelism_diagram_has_three_panels_with_their_layers():
    fig = plot_parallelism(n_layers=4)
    assert isinstance(fig, Figure)
    assert [ax.get_title().strip() for ax in fig.axes] == [
        "Data parallel", "Model (tensor) parallel", "Pipeline parallel"]
    texts = [[t.get_text() for t in ax.texts] for ax in fig.axes]
    assert sum(t.startswith("layer") for t in texts[0]) == 8  # both devices hold all 4 layers
    assert sum(t.startswith("layer") and "half" in t for t in texts[1]) == 8  # each device holds half of each of the 4 layers
    assert sum(t.startswith("layer") for t in texts[2]) == 4  # each device holds 2 of the 4 layers
    with pytest.raises(ValueError, match="n_layers"):
        plot_parallelism(n_layers=3)


def test_weight_histograms_one_outline_per_checkpoint_with_shared_bins():
    torch.manual_seed(0)
    states = {f"step {s}": {"w": torch.randn(50, 50) * (0.02 + 0.01 * s)} for s in range(3)}
    fig = plot_weight_histograms(states, "w", bins=30)
    outlines = fig.axes[0].patches
    assert len(outlines) == 3
    counts = [o.get_data().values for o in outlines]
    assert all(len(c) == 30 and c.sum() == 2500 for c in counts)
    edges = [tuple(o.get_data().edges) for o in outlines]
    assert edges[0] == edges[1] == edges[2]
    with pytest.raises(KeyError, match="'v' is not in state_dict 'step 0'"):
        plot_weight_histograms(states, "v")


def test_bar_table_signed_values():
    fig = plot_bar_table(["a", "b", "c"], [0.12, -0.05, float("nan")], ylabel="val loss - baseline")
    ax = fig.axes[0]
    assert [b.get_height() for b in ax.patches] == [0.12, -0.05, 0.0]
    assert [t.get_text() for t in ax.texts] == ["+0.120", "-0.050", "n/a"]
    assert [t.get_va() for t in ax.texts] == ["bottom", "top", "bottom"]
    assert ax.get_lines()[0].get_ydata()[0] == 0  # the zero line
    with pytest.raises(ValueError, match="one value per label"):
        plot_bar_table(["a"], [1.0, 2.0], ylabel="x")


def saved_width_px(fig, tmp_path) -> int:
    """The width of the PNG the notebook shows (saved as the inline backend saves it)."""
    from PIL import Image

    path = tmp_path / "figure.png"
    fig.savefig(path, dpi=INLINE_DPI, bbox_inches="tight")
    with Image.open(path) as image:
        return image.size[0]


def text_sizes_px(fig) -> list[float]:
    """The size in pixels at the inline dpi of every visible text: titles, labels, ticks, legend, annotations."""
    fig.canvas.draw()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    return [t.get_fontsize() * INLINE_DPI / 72 for t in texts]


@pytest.mark.parametrize("stages,micro_batches", [(4, 8), (2, 8), (2, 16)])
def test_pipeline_timelines_are_drawn_for_the_page_width_with_readable_numbers(tmp_path, stages, micro_batches):
    panels = {name: simulate_schedule(name, stages, micro_batches, forward_time=1e-3, backward_time=2e-3)
              for name in ("gpipe", "1f1b")}
    fig = plot_pipeline_timelines(panels, xlabel="time (a forward takes 1 unit)")
    assert PAGE_PX[0] <= saved_width_px(fig, tmp_path) <= PAGE_PX[1]
    assert min(text_sizes_px(fig)) >= MIN_TEXT_PX
    assert [ax.get_title() for ax in fig.axes] == ["gpipe", "1f1b"]
    assert len(fig.legends) == 1 and [t.get_text() for t in fig.legends[0].get_texts()] == [
        "forward", "backward", "idle"], "one legend for the figure, above the panels"
    for ax, (intervals, ids) in zip(fig.axes, panels.values()):
        numbers = [t.get_text() for t in ax.texts]
        bars = [str(i) for rank in ids for i in rank]
        assert len(bars) == 2 * stages * micro_batches
        if micro_batches <= 8:  # bars wide enough: every bar shows its micro-batch
            assert sorted(numbers) == sorted(bars)
        else:  # a number too wide for its bar is left out, never drawn over its neighbours
            assert 0 < len(numbers) < len(bars) and set(numbers) <= set(bars)
    with pytest.raises(ValueError, match="at least one panel"):
        plot_pipeline_timelines({})

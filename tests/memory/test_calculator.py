"""course_lib.memory.calculator: breakdowns equal the ZeRO and activation formulas; the widget redraws on change.

    .venv/bin/python -m pytest -q tests/memory/test_calculator.py
"""

import matplotlib

matplotlib.use("Agg")  # no display in tests

import matplotlib.pyplot as plt
import pytest

from course_lib.core.model import GPTConfig
from course_lib.memory.accounting import count_parameters
from course_lib.memory.activations import expected_saved_bytes, layer_terms
from course_lib.memory.calculator import (
    MODELS,
    MemoryBreakdown,
    activation_bytes,
    memory_calculator_figure,
    memory_calculator_widget,
    memory_per_gpu,
    plot_memory_breakdown,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_7b_stage0_fp32_adam_is_16_bytes_per_param():
    b = memory_per_gpu(7 * 10**9, precision="fp32", optimizer="adam")
    assert (b.params, b.grads, b.optimizer_states) == (4 * 7e9, 4 * 7e9, 8 * 7e9)
    assert b.model_states / b.n_params == 16
    assert not b.activations_estimated and b.activations == 0


def test_mixed_adamw_is_2_2_12():
    n = count_parameters(MODELS["llama-7b-like"])
    b = memory_per_gpu("llama-7b-like", precision="mixed")
    assert b.n_params == n
    assert (b.params, b.grads, b.optimizer_states) == (2 * n, 2 * n, 12 * n)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_zero_stages_divide_what_they_shard(world_size, precision):
    one = memory_per_gpu("gpt2-small", world_size=1, zero_stage=3, precision=precision)
    stages = [memory_per_gpu("gpt2-small", world_size=world_size, zero_stage=s, precision=precision) for s in range(4)]
    assert stages[0].model_states == one.model_states  # stage 0 = DDP: every rank holds everything
    assert stages[1].optimizer_states == pytest.approx(one.optimizer_states / world_size)
    assert stages[1].grads == one.grads and stages[1].params == one.params
    assert stages[2].grads == pytest.approx(one.grads / world_size) and stages[2].params == one.params
    for key in ("params", "grads", "optimizer_states"):
        assert getattr(stages[3], key) == pytest.approx(getattr(one, key) / world_size)
    # activations are not sharded by ZeRO
    assert len({s.activations for s in stages}) == 1 and stages[0].activations > 0


def test_activations_use_the_exact_formula():
    config = GPTConfig.from_preset("small")
    b = memory_per_gpu(config, precision="fp32", micro_batch=3, seq_len=40)
    assert b.activations == sum(expected_saved_bytes(config, 3, 40, dtype="fp32").values())
    ckpt = memory_per_gpu(config, precision="fp32", micro_batch=3, seq_len=40, activation_checkpointing=True)
    one_block = sum(layer_terms(config, 3, 40).values())
    kept = config.n_layer * 4 * 3 * 40 * config.n_embd  # every block's fp32 input
    assert ckpt.activations == b.activations - config.n_layer * one_block + kept + one_block
    assert ckpt.activations < b.activations
    # mixed: bf16 activations without autocast's weight copies (the 16-bit params are saved instead)
    mixed = activation_bytes(config, 3, 40, precision="mixed")
    with_copies = sum(expected_saved_bytes(config, 3, 40, dtype="bf16").values())
    copies = config.n_layer * 2 * (4 * 128**2 + 3 * 128 * config.ffn_hidden) + 2 * config.vocab_size * 128
    assert mixed == with_copies - copies


def test_shape_dict_and_aliases():
    by_dict = memory_per_gpu({"layers": 4, "hidden": 128, "heads": 4}, seq_len=64)
    assert by_dict.n_params == count_parameters(GPTConfig(n_layer=4, n_embd=128, n_head=4))
    assert by_dict.total == memory_per_gpu(GPTConfig(n_layer=4, n_embd=128, n_head=4), seq_len=64).total


@pytest.mark.parametrize("kwargs,field", [
    (dict(world_size=0), "world_size"), (dict(zero_stage=4), "zero_stage"), (dict(precision="fp8"), "precision"),
    (dict(optimizer="lion"), "optimizer"), (dict(micro_batch=0), "micro_batch"), (dict(seq_len=1), "seq_len"),
    (dict(activation_checkpointing="yes"), "activation_checkpointing"), (dict(model="gpt5"), "model"),
    (dict(model={"layers": 2, "width": 64}), "model"), (dict(model=-3), "model"),
    (dict(attn_impl="flash"), "attn_impl"),
])
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        memory_per_gpu(**kwargs)


def test_plot_heights_are_the_breakdown_in_gb():
    b = memory_per_gpu("llama-7b-like", world_size=8, zero_stage=3)
    fig = plot_memory_breakdown({"a": b})
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([b.params / 1e9, b.grads / 1e9, b.optimizer_states / 1e9, b.activations / 1e9])
    assert any("fits" in t.get_text() for t in ax.texts)
    assert any(line.get_ydata()[0] == pytest.approx(80) for line in ax.lines)  # the 80 GB line


def test_book_figure_shows_eight_bars_with_a_verdict_each():
    fig = memory_calculator_figure()
    assert len(fig.axes) == 2  # without and with activation checkpointing, four ZeRO stages each
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert sum("does not fit" in t for t in texts) >= 1 and sum(t.endswith("\nfits") for t in texts) >= 1
    assert sum(len(ax.patches) for ax in fig.axes) == 8 * 4
    assert fig.get_size_inches()[0] <= 8.5  # readable at the width of a book page


def test_widget_builds_and_redraws_when_a_control_changes():
    calculator = memory_calculator_widget(zero_stage=0, world_size=8)
    assert isinstance(calculator.breakdown, MemoryBreakdown)
    before = calculator.breakdown.total
    assert "does NOT fit" in calculator.summary.value  # 7B-like, ZeRO-0: 16 B/param alone exceed 80 GB
    calculator.controls["zero_stage"].value = 3  # traitlets calls the observers synchronously
    assert calculator.breakdown.zero_stage == 3 and calculator.breakdown.total < before
    assert " fits" in calculator.summary.value
    heights = sum(p.get_height() for p in calculator.figure.axes[0].patches)
    assert heights == pytest.approx(calculator.breakdown.total / 1e9)
    assert bytes(calculator.plot.value).startswith(b"\x89PNG"), "the bar is shown as a PNG image, redrawn on change"
    calculator.controls["activation_checkpointing"].value = True
    assert calculator.breakdown.activation_checkpointing
    with pytest.raises(ValueError, match="unknown control"):
        memory_calculator_widget(stage=2)

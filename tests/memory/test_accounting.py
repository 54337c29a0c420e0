"""course_lib.memory.accounting: parameter counts from shapes, bytes per parameter, measured tensor bytes."""

import pytest
import torch

from course_lib.core.model import GPT, PRESETS, GPTConfig
from course_lib.memory.accounting import (
    GPU_80GB,
    count_parameters,
    estimate_training_memory,
    format_bytes,
    measure_training_memory,
    memory_table,
)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_parameters_matches_the_model(name):
    with torch.device("meta"):  # shapes only: GPT-2-small costs no memory here
        model = GPT(PRESETS[name])
    assert count_parameters(PRESETS[name]) == model.num_params()


def test_count_parameters_by_hand_for_tiny():
    V, C, L, F = 256, 64, 2, 128  # the tiny preset
    assert count_parameters(PRESETS["tiny"]) == V * C + L * (4 * C * C + 3 * C * F + 2 * C) + C == 98_624


def test_count_parameters_of_an_unusual_shape():
    config = GPTConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=12, ffn_hidden=20)
    assert count_parameters(config) == GPT(config).num_params()


def test_7b_adam_is_16_bytes_per_parameter_in_fp32_and_mixed_precision():
    n = 7 * 10**9
    fp32 = estimate_training_memory(n, precision="fp32", optimizer="adamw")
    mixed = estimate_training_memory(n, precision="mixed", optimizer="adamw")
    assert fp32.total == mixed.total == 16 * n == 112 * 10**9
    assert (fp32.weights, fp32.gradients, fp32.master_weights, fp32.optimizer_states) == (4 * n, 4 * n, 0, 8 * n)
    assert (mixed.weights, mixed.gradients, mixed.master_weights, mixed.optimizer_states) == (2 * n, 2 * n, 4 * n, 8 * n)
    assert mixed.bytes_per_param == 16
    assert fp32.total > GPU_80GB  # the point of the lesson


@pytest.mark.parametrize("optimizer,expected", [("sgd", 8), ("sgd_momentum", 12), ("adam", 16)])
def test_bytes_per_parameter_by_optimizer(optimizer, expected):
    assert estimate_training_memory(1000, optimizer=optimizer).bytes_per_param == expected


def test_activations_add_to_total_but_not_to_model_states():
    e = estimate_training_memory(10, activations=500)
    assert e.model_states == 160 and e.total == 660


@pytest.mark.parametrize("kwargs,match", [
    ({"n_params": 0}, "n_params"), ({"n_params": 1.5e9}, "n_params"),
    ({"n_params": 10, "precision": "fp8"}, "precision"), ({"n_params": 10, "optimizer": "lion"}, "optimizer"),
])
def test_bad_input_names_the_argument(kwargs, match):
    n = kwargs.pop("n_params")
    with pytest.raises(ValueError, match=match):
        estimate_training_memory(n, **kwargs)


def test_measured_bytes_of_a_trained_tiny_model_match_the_estimate():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 16))
    model(idx, targets=idx)[1].backward()
    optimizer.step()
    measured = measure_training_memory(model, optimizer)
    estimate = estimate_training_memory(model.num_params(), precision="fp32", optimizer="adamw")
    assert measured["weights"] == estimate.weights  # the tied lm_head counts once
    assert measured["gradients"] == estimate.gradients
    # Adam keeps m and v per value, plus one fp32 step counter per parameter tensor.
    n_tensors = len(list(model.parameters()))
    assert measured["optimizer_states"] == estimate.optimizer_states + 4 * n_tensors


def test_measure_without_gradients_or_optimizer():
    model = GPT(PRESETS["tiny"])
    measured = measure_training_memory(model)
    assert measured == {"weights": 4 * model.num_params(), "gradients": 0, "optimizer_states": 0}


def test_format_bytes_and_table():
    assert format_bytes(112 * 10**9) == "112 GB"
    assert format_bytes(1_577_984) == "1.58 MB"
    assert format_bytes(12) == "12 B"
    table = memory_table({"tiny": 98_624, "7B": 7 * 10**9})
    assert "112 GB" in table and "no (1.4x)" in table
    assert table.splitlines()[3].rstrip().endswith("yes")

"""course_lib.precision.comparison: fp32, bf16 and fp16+GradScaler train the tiny model alike; fp16 needs the scale.

    .venv/bin/python -m pytest -q tests/precision/test_comparison.py
"""

import math

import pytest
import torch

from course_lib.precision.comparison import (
    gradient_sample,
    max_loss_gap,
    precision_comparison,
    step_noise,
    underflow_fractions,
)

STEPS = 16


@pytest.fixture(scope="module")
def runs():
    return precision_comparison(steps=STEPS, batch_size=4, seq_len=32, warmup_steps=2)


def test_every_precision_trains(runs):
    assert list(runs) == ["fp32", "bf16", "fp16"]
    for name, run in runs.items():
        losses = run["losses"]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), name
        assert losses[0] == pytest.approx(math.log(256), abs=0.2), name  # untrained: ~ln(vocab)
        assert sum(losses[-4:]) / 4 < losses[0] - 0.5, f"{name}: the loss did not fall"
        assert run["tokens_per_s"] > 0 and len(run["step_seconds"]) == STEPS


def test_bf16_and_fp16_follow_fp32(runs):
    # Same weights, same batches: only rounding differs. bf16 keeps 8 significant bits, so each matmul input
    # is off by up to 2^-9 relative; over 16 steps that moves a loss of 2-5 nats by about 1e-3. We allow
    # 0.05 nats, well below the loss drop the test above requires (0.5) and above what rounding produces.
    assert max_loss_gap(runs, "fp32", "bf16") < 0.05
    assert max_loss_gap(runs, "fp32", "fp16") < 0.05
    assert max_loss_gap(runs, "fp32", "bf16") > 0  # they are different computations, not one run twice


def test_fp16_scaler_records_its_scale(runs):
    fp16 = runs["fp16"]
    assert len(fp16["scales"]) == STEPS and fp16["scales"][0] == 2.0**16  # GradScaler's default initial scale
    # a skipped step halves the scale for the next one
    for step in fp16["skipped_steps"]:
        if step + 1 < STEPS:
            assert fp16["scales"][step + 1] == fp16["scales"][step] / 2
    assert "scales" in runs["fp32"] and runs["fp32"]["scales"] == []


def test_step_noise_of_a_known_series():
    assert step_noise([0.0, 1.0, 0.0, 1.0, 0.0]) == pytest.approx(1.0 / math.sqrt(2))
    assert step_noise([1.0, 2.0, 3.0, 4.0]) == 0.0


def test_fp16_loses_small_gradients_that_bf16_and_scaling_keep():
    grads = torch.tensor([1e-9, 2e-8, 1e-6, 1e-3, 0.0])
    unscaled, scaled = underflow_fractions(grads, scales=(1.0, 2.0**16))
    # 1e-9 and 2e-8 round to 0: below half of fp16's smallest subnormal 6e-8
    assert unscaled["fp16"] == pytest.approx(2 / 4)
    assert unscaled["bf16"] == 0.0  # bf16 reaches 1e-38
    assert unscaled["fp16_subnormal"] == pytest.approx(1 / 4)  # 1e-6: kept, but with few bits
    assert scaled["fp16"] == 0.0
    real = underflow_fractions(gradient_sample(batch_size=2, seq_len=16))
    assert real[0]["fp16_subnormal"] > real[1]["fp16_subnormal"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(precisions=("fp8",)), "precisions"), (dict(steps=1), "steps"),
    (dict(steps=4, warmup_steps=4), "warmup_steps"),
])
def test_bad_input_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        precision_comparison(**kwargs)

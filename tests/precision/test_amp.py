"""Number ranges and loss scaling behave as the lesson says."""

import math

from course_lib.precision.amp import loss_scaling_run, range_table, underflow_demo


def test_ranges():
    rows = {row["value"]: row for row in range_table()}
    assert rows[1e5]["fp16"] == math.inf and math.isfinite(rows[1e5]["bf16"])  # fp16 overflows, bf16 doesn't
    assert rows[1e-8]["fp16"] == 0.0 and rows[1e-8]["bf16"] != 0.0  # fp16 underflows
    assert rows[1.0 + 1e-3]["bf16"] == 1.0 and rows[1.0 + 1e-3]["fp16"] != 1.0  # bf16 has fewer mantissa bits


def test_underflow_fixed_by_scaling():
    demo = underflow_demo(gradient=1e-8)
    assert demo["fp16"] == 0.0
    assert abs(demo["fp16_scaled_then_unscaled"] - 1e-8) / 1e-8 < 1e-2


def test_overflow_skips_step_and_halves_scale():
    records = loss_scaling_run(steps=10, overflow_steps=(3, 4), init_scale=1024.0, growth_interval=3)
    skipped = [r["step"] for r in records if r["skipped"]]
    assert skipped == [3, 4]
    assert records[4]["scale"] == records[3]["scale"] / 2
    assert records[5]["scale"] == records[3]["scale"] / 4
    assert records[8]["scale"] == records[5]["scale"] * 2  # three clean steps (5, 6, 7) double it
    assert records[-1]["loss"] < records[0]["loss"]

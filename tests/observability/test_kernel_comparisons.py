"""Fused and unfused kernels compute the same thing; the fused ones dispatch fewer kernels and touch fewer bytes."""

import pytest
import torch
import torch.nn.functional as F

from course_lib.observability.kernel_comparisons import (
    ADAMW_IMPLS,
    adamw_comparison,
    attention_comparison,
    format_rows,
    make_adamw,
    op_summary,
    record_ops,
    silu_comparison,
)


def test_record_ops_counts_kernels_and_bytes():
    x = torch.randn(1000)
    unfused = op_summary(record_ops(lambda: x * torch.sigmoid(x)))
    fused = op_summary(record_ops(lambda: F.silu(x)))
    assert unfused["kernels"] == 2 and fused["kernels"] == 1
    # sigmoid reads x and writes s; mul reads x and s and writes y: 5 tensors of 4000 bytes against 2
    assert unfused["bytes_touched"] == 5 * 4000 and fused["bytes_touched"] == 2 * 4000


def test_record_ops_leaves_out_operations_that_return_no_tensor():
    x = torch.randn(10)

    def fn():
        return x.to(torch.promote_types(x.dtype, torch.float32)) * 2  # promote_types dispatches, runs no kernel

    every = record_ops(fn, kernels_only=False)
    assert "promote_types" in [c.name for c in every]
    assert [c.name for c in record_ops(fn)] == ["mul"]


def test_record_ops_sees_what_autocast_runs():
    layer = torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        calls = record_ops(lambda: layer(torch.randn(2, 8)))
    matmuls = [c for c in calls if c.name in ("addmm", "mm", "linear")]
    assert matmuls and all(c.output_dtypes == ("bfloat16",) for c in matmuls)


def test_silu_variants_agree():
    result = silu_comparison(numel=4096, rounds=2, warmup=1)
    torch.testing.assert_close(result["outputs"]["F.silu(x)"], result["outputs"]["x * sigmoid(x)"])
    baseline = result["rows"][0]
    assert baseline["speedup"] == 1.0 and all(r["median_ms"] > 0 for r in result["rows"])


def test_adamw_implementations_agree_and_fused_dispatches_least():
    shapes = [(16, 8), (8,), (4, 4)]
    result = adamw_comparison(shapes, rounds=2, warmup=1)
    for impl in ADAMW_IMPLS[1:]:
        for got, expected in zip(result["params"][impl], result["params"]["for-loop"]):
            torch.testing.assert_close(got, expected, msg=f"{impl} differs from the for-loop AdamW")
    kernels = {row["variant"]: row["kernels"] for row in result["rows"]}
    assert kernels["fused"] < kernels["foreach"] < kernels["for-loop"]
    # the for-loop implementation runs the same kernels once per tensor: twice the tensors, twice the kernels
    doubled = adamw_comparison(shapes * 2, rounds=1, warmup=0)
    assert {r["variant"]: r["kernels"] for r in doubled["rows"]}["for-loop"] == 2 * kernels["for-loop"]
    assert {r["variant"]: r["kernels"] for r in doubled["rows"]}["fused"] == kernels["fused"]


def test_attention_variants_agree_and_sdpa_skips_the_scores():
    result = attention_comparison(batch=1, n_head=2, seq_len=32, head_dim=8, backward=True, rounds=2, warmup=1)
    torch.testing.assert_close(result["outputs"]["sdpa"], result["outputs"]["explicit"])
    touched = {row["variant"]: row["mb_touched"] for row in result["rows"]}
    assert touched["explicit"] > result["scores_mb"] and touched["sdpa"] < touched["explicit"]
    assert "explicit" in format_rows(result["rows"]) and "sdpa" in format_rows(result["rows"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="impl must be one of"):
        make_adamw([torch.zeros(1, requires_grad=True)], "apex")
    with pytest.raises(ValueError, match="shapes is empty"):
        adamw_comparison([])
    with pytest.raises(ValueError, match="numel"):
        silu_comparison(numel=0)

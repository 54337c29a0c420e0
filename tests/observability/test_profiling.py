"""Profiling: a step's phases, the profiler's table and Chrome trace, the split on 2 DDP ranks, and MFU figures.

    .venv/bin/python -m pytest -q tests/observability/test_profiling.py
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from course_lib.data_parallel.experiment_workers import ddp_step_breakdown
from course_lib.hybrid.planner import Cluster
from course_lib.observability.profiling import (
    CATEGORIES,
    GPU_PEAK_TFLOPS,
    PHASES,
    format_breakdown,
    format_throughput,
    gpu_peak,
    gpu_peak_flops,
    make_setup,
    measure_throughput,
    mfu_text,
    peak_text,
    profile_steps,
    run_step,
    step_breakdown,
    throughput_report,
    without_profiler_banner,
)
from course_lib.runtime.launch import launch


def test_the_one_cycle_warning_of_torch_2_11_is_dropped_and_other_warnings_pass():
    one_cycle = ("Warning: Profiler clears events at the end of each cycle.Only events from the current cycle will be "
                 "reported.To keep events across cycles, set acc_events=True.")  # torch 2.11's words, at every start
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with without_profiler_banner():
            warnings.warn(one_cycle, UserWarning)
            warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in shown] == ["something else"]


def test_run_step_times_every_phase_and_trains(one_thread):
    model, optimizer, batches = make_setup("tiny", batch_size=4)
    before = model.blocks[0].attn.q_proj.weight.detach().clone()
    times = run_step(model, optimizer, batches)
    assert set(times) == {"data", "forward", "backward", "optimizer", "total"}
    assert all(t > 0 for t in times.values())
    assert times["total"] == pytest.approx(sum(times[p] for p in PHASES if p in times))
    assert not torch.equal(model.blocks[0].attn.q_proj.weight, before), "the optimizer step must update the weights"
    assert all(p.grad is None for p in model.parameters()), "gradients are cleared after the step"
    called = []
    times = run_step(model, optimizer, batches, communicate=lambda: called.append(True))
    assert called == [True] and times["communication"] >= 0
    medians = step_breakdown(model, optimizer, batches, steps=3, warmup=1)
    text = format_breakdown(medians)
    assert text.startswith("data ") and "forward" in text and "optimizer" in text


def test_profile_writes_a_chrome_trace_with_named_phases(tmp_path, one_thread):
    model, optimizer, batches = make_setup("tiny", batch_size=4)
    report = profile_steps(lambda: run_step(model, optimizer, batches), steps=2, warmup=1, out_dir=tmp_path / "prof")
    assert report.trace_path == tmp_path / "prof" / "trace.json"
    trace = json.loads(report.trace_path.read_text())
    ranges = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    for name in ("data", "forward", "backward", "optimizer"):
        assert sum(e["name"] == name for e in ranges) == 2, f"every profiled step has a '{name}' range"
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "aten::mm" in report.table and "Self CPU" in report.table
    selfs = [op["self_ms"] for op in report.top_operators]
    assert selfs == sorted(selfs, reverse=True) and report.top_operators[0]["calls"] >= 1
    assert set(report.shares) == set(CATEGORIES)
    assert sum(report.shares.values()) == pytest.approx(1.0)
    assert report.shares["matmul"] > 0 and report.shares["optimizer"] > 0 and report.shares["communication"] == 0


@pytest.mark.distributed
def test_ddp_breakdown_on_two_ranks(tmp_path):
    results = launch(ddp_step_breakdown, 2, kwargs=dict(steps=2, warmup=1, batch_size=4, return_params=True),
                     log_dir=tmp_path, threads_per_rank=1, echo=False)
    model, _, _ = make_setup("tiny")
    for r in results:
        assert r["bytes"] == 4 * model.num_params()
        assert set(r["separate"]) == set(PHASES) | {"total"}
        assert "communication" not in r["ddp"], "torch DDP's all-reduce is inside its backward"
        assert r["separate"]["communication"] > 0
        assert r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"])  # 2 (n - 1) / n = 1 for two ranks
    # Both kinds of step averaged the gradients: the replicas stay identical.
    torch.testing.assert_close(results[1]["params"], results[0]["params"], rtol=0, atol=0)


def test_throughput_report_and_gpu_peaks():
    report = throughput_report(tokens_per_step=1000, step_s=0.5, flops_per_token=600, ceiling_flops=2.4e6,
                               ceiling="test")
    assert report["tokens_per_s"] == 2000 and report["achieved_flops"] == 1.2e6 and report["fraction"] == 0.5
    unknown = throughput_report(tokens_per_step=1, step_s=1, flops_per_token=1, ceiling_flops=None,
                                ceiling="MFU unknown (no peak figure for Quadro P1000)")
    assert unknown["fraction"] is None
    assert format_throughput(unknown) == "1 tokens/s, 0.00 GFLOP/s; MFU unknown (no peak figure for Quadro P1000)"
    assert format_throughput(report).endswith("= 50.0% of test (0.0 GFLOP/s)")
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("NVIDIA L40S") == 362e12 and gpu_peak_flops("NVIDIA L4") == 121e12
    assert gpu_peak_flops("NVIDIA A10") == 125e12
    assert gpu_peak_flops("Quadro P1000") is None


# The names torch.cuda.get_device_name() gives each part, and the part (with its dense peak) they must find.
DEVICE_NAMES = {
    "NVIDIA A100-SXM4-40GB": ("A100 SXM4", 312), "NVIDIA A100-SXM4-80GB": ("A100 SXM4", 312),
    "NVIDIA A100-PCIE-40GB": ("A100 PCIe", 312), "NVIDIA A100 80GB PCIe": ("A100 PCIe", 312),
    "NVIDIA H100 80GB HBM3": ("H100 SXM5", 989), "NVIDIA H100 PCIe": ("H100 PCIe", 756),
    "NVIDIA H100 NVL": ("H100 NVL", 835), "NVIDIA H200": ("H200 SXM", 989), "NVIDIA H200 NVL": ("H200 NVL", 835),
    "NVIDIA GH200 480GB": ("GH200", 989), "NVIDIA B200": ("B200", 2250), "NVIDIA L40S": ("L40S", 362),
    "NVIDIA L40": ("L40", 181), "NVIDIA L4": ("L4", 121), "NVIDIA A10": ("A10", 125),
    "Tesla V100-SXM2-32GB": ("V100 SXM2", 125), "Tesla V100-PCIE-16GB": ("V100 PCIe", 112),
}


@pytest.mark.parametrize("name", sorted(DEVICE_NAMES))
def test_each_device_name_finds_its_exact_part(name):
    part, tflops = DEVICE_NAMES[name]
    peak = gpu_peak(name)
    assert peak is not None and (peak.part, peak.tflops) == (part, tflops)
    assert gpu_peak_flops(name) == tflops * 1e12
    assert peak.source.startswith("NVIDIA ") and "https://" in peak.source, "every figure names its datasheet"
    matching = [p.part for p in GPU_PEAK_TFLOPS.values()
                if any(re.fullmatch(n, name.removeprefix("NVIDIA ").removeprefix("Tesla "), re.I) for n in p.names)]
    assert matching == [part], "a name matches one part only: the order of the table decides nothing"


def test_parts_that_share_a_family_name_do_not_take_each_others_peak():
    # The earlier table matched by substring, so these got the H100 SXM's 989 (and an A10G the A10's 125).
    assert gpu_peak_flops("NVIDIA H100 NVL") != 989e12 and gpu_peak_flops("NVIDIA H100 PCIe") != 989e12
    assert gpu_peak_flops("NVIDIA H200 NVL") != 989e12
    for unknown in ("NVIDIA A10G", "NVIDIA H100", "NVIDIA GB200", "NVIDIA H800", "NVIDIA GeForce RTX 4090", ""):
        assert gpu_peak(unknown) is None and gpu_peak_flops(unknown) is None, unknown
    assert set(GPU_PEAK_TFLOPS) >= {"A100 SXM4", "A100 PCIe", "H100 SXM5", "H100 PCIe", "H100 NVL", "H200 SXM",
                                    "H200 NVL", "B200", "GH200", "L40S", "L4", "A10"}
    # The 3D planner's cluster is of H100 SXM GPUs: its peak is the table's.
    assert Cluster().peak_flops == GPU_PEAK_TFLOPS["H100 SXM5"].tflops * 1e12


def test_every_mfu_line_names_its_peak_and_source_or_says_it_is_unknown():
    line = mfu_text(466.7e12, "NVIDIA H100 80GB HBM3")
    assert line.startswith("MFU 47.2% of 989 TFLOP/s (H100 SXM5 dense bf16 peak; NVIDIA H100 Tensor Core GPU datasheet")
    assert mfu_text(300e12, "NVIDIA H100 NVL").startswith("MFU 35.9% of 835 TFLOP/s (H100 NVL dense bf16 peak;")
    assert mfu_text(1e12, "NVIDIA RTX 9999") == "MFU unknown (no peak figure for NVIDIA RTX 9999)"
    assert peak_text("NVIDIA B200").startswith("2250 TFLOP/s (B200 dense bf16 peak; NVIDIA HGX B200")


def test_measure_throughput_on_cpu(one_thread):
    model, optimizer, batches = make_setup("tiny", batch_size=4)
    report = measure_throughput(model, optimizer, batches, rounds=2, warmup=1)
    assert report["tokens_per_step"] == 4 * model.config.block_size
    assert report["flops_per_token"] == model.flops_per_token(model.config.block_size)
    assert "matmul" in report["ceiling"] and report["ceiling_flops"] > 0
    assert 0 < report["fraction"] < 1, "a tiny model's step cannot beat a large matmul"
    assert report["achieved_flops"] == pytest.approx(report["flops_per_token"] * report["tokens_per_s"])

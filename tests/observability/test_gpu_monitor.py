"""course_lib.observability.gpu_monitor: nvidia-smi CSV as real drivers print it, NVML through a stand-in module, no GPU, CUDA."""

import json
import os
import stat
import sys
import types

import pytest
import torch

from course_lib.observability import gpu_monitor
from course_lib.observability.gpu_monitor import (
    MIB,
    QUERY_FIELDS,
    GPUSnapshot,
    format_snapshot,
    gpu_snapshot,
    main,
    parse_nvidia_smi_csv,
    summarise_allocator,
    torch_memory,
)

# `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv` on a node of H100s in the middle of a training run.
H100_CSV = """\
index, pci.bus_id, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%], utilization.memory [%], \
temperature.gpu, power.draw [W], power.limit [W], driver_version
0, 00000000:18:00.0, NVIDIA H100 80GB HBM3, 71243 MiB, 81559 MiB, 98 %, 41 %, 63, 612.37 W, 700.00 W, 550.90.07
1, 00000000:2A:00.0, NVIDIA H100 80GB HBM3, 71241 MiB, 81559 MiB, 97 %, 40 %, 58, 598.02 W, 700.00 W, 550.90.07
"""
# `--format=csv,nounits`: the units stay in the header only; an idle A100 and a T4, fields in another order.
NOUNITS_CSV = """\
name, index, memory.total [MiB], memory.used [MiB], power.draw [W], temperature.gpu, utilization.gpu [%]
NVIDIA A100-SXM4-40GB, 0, 40960, 3, 52.11, 29, 0
Tesla T4, 1, 15360, 0, 9.84, 38, 0
"""
# MIG mode: per-GPU utilisation is not available; some boards do not report power.
NOT_AVAILABLE_CSV = """\
index, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%], utilization.memory [%], temperature.gpu, \
power.draw [W], power.limit [W]
0, NVIDIA A100-SXM4-80GB, 13 MiB, 81920 MiB, [N/A], [N/A], 31, [Not Supported], [N/A]
"""
DRIVER_FAILURE = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
                  "latest NVIDIA driver is installed and running.")


def test_parses_a_busy_h100_node():
    gpus = parse_nvidia_smi_csv(H100_CSV)
    assert [g.index for g in gpus] == [0, 1]
    first = gpus[0]
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.pci_bus_id == "00000000:18:00.0"
    assert first.memory_used_bytes == 71243 * MIB and first.memory_total_bytes == 81559 * MIB
    assert (first.utilization_gpu_pct, first.utilization_memory_pct) == (98.0, 41.0)
    assert (first.temperature_c, first.power_w, first.power_limit_w) == (63.0, 612.37, 700.0)
    assert gpus[1].power_w == 598.02


def test_nounits_output_takes_units_from_the_header_in_any_field_order():
    a100, t4 = parse_nvidia_smi_csv(NOUNITS_CSV)
    assert (a100.index, a100.name, a100.memory_total_bytes, a100.memory_used_bytes) == (
        0, "NVIDIA A100-SXM4-40GB", 40960 * MIB, 3 * MIB)
    assert (t4.index, t4.name, t4.memory_total_bytes, t4.power_w, t4.temperature_c) == (
        1, "Tesla T4", 15360 * MIB, 9.84, 38.0)
    assert a100.utilization_memory_pct is None and a100.power_limit_w is None  # not queried


def test_not_available_fields_become_none():
    (gpu,) = parse_nvidia_smi_csv(NOT_AVAILABLE_CSV)
    assert gpu.memory_total_bytes == 81920 * MIB
    assert gpu.utilization_gpu_pct is None and gpu.utilization_memory_pct is None
    assert gpu.power_w is None and gpu.power_limit_w is None
    assert gpu.temperature_c == 31.0
    assert "- / - W" in format_snapshot(GPUSnapshot(gpus=[gpu], source="nvidia-smi"))


@pytest.mark.parametrize("text,match", [
    ("", "header"),
    ("0, NVIDIA H100 80GB HBM3, 1 MiB", "header"),
    ("index, name, memory.used [MiB]\n0, NVIDIA H100 80GB HBM3", "line 2 has 2 fields"),
])
def test_malformed_csv_gets_a_clear_error(text, match):
    with pytest.raises(ValueError, match=match):
        parse_nvidia_smi_csv(text)


def fake_nvidia_smi(tmp_path, stdout: str, exit_code: int = 0):
    """An executable that records its arguments and prints `stdout`, as nvidia-smi would."""
    script = tmp_path / "nvidia-smi"
    (tmp_path / "out.txt").write_text(stdout)
    script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/args.txt"\ncat "{tmp_path}/out.txt"\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as the fake nvidia-smi")
def test_snapshot_from_nvidia_smi(tmp_path):
    script = fake_nvidia_smi(tmp_path, H100_CSV)
    snapshot = gpu_snapshot(use_nvml=False, nvidia_smi=str(script))
    assert snapshot and snapshot.source == "nvidia-smi" and snapshot.reason == ""
    assert snapshot.driver_version == "550.90.07"
    assert [g.memory_used_bytes for g in snapshot.gpus] == [71243 * MIB, 71241 * MIB]
    args = (tmp_path / "args.txt").read_text().split()
    assert args == [f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv"]
    table = format_snapshot(snapshot)
    assert "NVIDIA H100 80GB HBM3" in table and "71243 / 81559 MiB" in table and "612 / 700 W" in table


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as the fake nvidia-smi")
def test_failing_nvidia_smi_is_reported_with_its_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    script = fake_nvidia_smi(tmp_path, DRIVER_FAILURE, exit_code=9)
    snapshot = gpu_snapshot(nvidia_smi=str(script))
    assert not snapshot and snapshot.gpus == []
    assert "pynvml" in snapshot.reason
    assert "exited with code 9" in snapshot.reason and "couldn't communicate with the NVIDIA driver" in snapshot.reason


def test_no_gpu_gives_an_empty_snapshot_and_the_reasons(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    missing = "nvidia-smi-that-does-not-exist"
    snapshot = gpu_snapshot(nvidia_smi=missing)
    assert not snapshot and snapshot.source is None
    assert snapshot.reason == f"pynvml (pip package nvidia-ml-py) is not installed; {missing} is not on PATH"
    assert format_snapshot(snapshot) == f"no NVIDIA GPU found ({snapshot.reason})"
    assert main(["--nvidia-smi", missing]) == 1
    assert capsys.readouterr().out.strip() == f"no NVIDIA GPU found ({snapshot.reason})"
    assert main(["--nvidia-smi", missing, "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["gpus"] == [] and record["reason"] == snapshot.reason


class _NotSupported(Exception):
    pass


def fake_pynvml(shutdowns: list):
    """A stand-in for nvidia-ml-py with two GPUs; the second reports neither power nor utilisation."""
    def not_supported(*_):
        raise _NotSupported("Not Supported")

    module = types.SimpleNamespace(NVML_TEMPERATURE_GPU=0)
    module.nvmlInit = lambda: None
    module.nvmlShutdown = lambda: shutdowns.append(True)
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetName = lambda h: b"NVIDIA A100-SXM4-80GB" if h == 0 else "NVIDIA L4"  # old and new pynvml
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(1 + h) * 2**30, total=80 * 2**30)
    module.nvmlDeviceGetUtilizationRates = lambda h: (types.SimpleNamespace(gpu=87, memory=33) if h == 0
                                                      else not_supported())
    module.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:07:00.0")
    module.nvmlDeviceGetTemperature = lambda h, sensor: 45 + h
    module.nvmlDeviceGetPowerUsage = lambda h: 250_500 if h == 0 else not_supported()
    module.nvmlDeviceGetEnforcedPowerLimit = lambda h: 400_000 if h == 0 else not_supported()
    module.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    module.nvmlSystemGetCudaDriverVersion = lambda: 12040
    return module


def test_snapshot_from_nvml(monkeypatch):
    shutdowns = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(shutdowns))
    snapshot = gpu_snapshot(nvidia_smi="nvidia-smi-that-does-not-exist")
    assert snapshot.source == "nvml" and shutdowns == [True]
    assert (snapshot.driver_version, snapshot.cuda_driver_version) == ("550.54.15", "12.4")
    a100, l4 = snapshot.gpus
    assert (a100.name, a100.pci_bus_id, a100.memory_used_bytes) == ("NVIDIA A100-SXM4-80GB", "00000000:07:00.0", 2**30)
    assert (a100.power_w, a100.power_limit_w, a100.utilization_gpu_pct) == (250.5, 400.0, 87.0)  # milliwatts -> W
    assert (l4.name, l4.temperature_c, l4.power_w, l4.utilization_gpu_pct) == ("NVIDIA L4", 46, None, None)


def test_nvml_without_a_driver_falls_back_to_nvidia_smi_reason(monkeypatch):
    module = fake_pynvml([])

    def no_driver():
        raise _NotSupported("Driver Not Loaded")
    module.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", module)
    snapshot = gpu_snapshot(nvidia_smi="nvidia-smi-that-does-not-exist")
    assert not snapshot
    assert snapshot.reason.startswith("NVML could not start: Driver Not Loaded; ")


def test_allocator_summary_reports_reserved_minus_allocated():
    stats = {"allocated_bytes.all.current": 3 * 2**30, "reserved_bytes.all.current": 5 * 2**30,
             "allocated_bytes.all.peak": 4 * 2**30, "reserved_bytes.all.peak": 6 * 2**30,
             "inactive_split_bytes.all.current": 2**29, "num_alloc_retries": 7, "num_ooms": 1}
    summary = summarise_allocator(stats)
    assert summary == {"allocated": 3 * 2**30, "reserved": 5 * 2**30, "max_allocated": 4 * 2**30,
                       "max_reserved": 6 * 2**30, "fragmentation": 2 * 2**30, "inactive_split": 2**29,
                       "alloc_retries": 7, "ooms": 1}


def test_allocator_summary_of_a_process_that_never_touched_cuda():
    assert summarise_allocator({})["fragmentation"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_torch_memory_is_none_without_cuda():
    assert torch_memory() is None
    assert gpu_monitor.allocator_line() == "torch allocator: no CUDA device in this process"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_memory_and_snapshot_on_a_real_gpu():
    before = torch_memory()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB
    during = torch_memory()
    assert during["allocated"] - before["allocated"] >= block.numel()
    assert during["reserved"] >= during["allocated"]
    assert during["fragmentation"] == during["reserved"] - during["allocated"]
    assert during["max_allocated"] >= during["allocated"]
    del block
    snapshot = gpu_snapshot()
    assert snapshot, f"CUDA works but no GPU was found: {snapshot.reason}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:  # NVML and nvidia-smi list every GPU of the node, CUDA only the visible ones
        assert len(snapshot.gpus) == torch.cuda.device_count()
    assert all(g.memory_total_bytes and g.memory_total_bytes > 0 for g in snapshot.gpus)

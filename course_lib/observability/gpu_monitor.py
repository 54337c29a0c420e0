"""What the NVIDIA GPUs of this machine are doing: memory, utilisation, temperature, power, and torch's allocator.

    python -m course_lib.observability.gpu_monitor              # one table, or "no NVIDIA GPU found (reason)" and exit code 1
    python -m course_lib.observability.gpu_monitor --watch 5    # a new table every 5 seconds (Ctrl-C stops), like nvidia-smi -l 5
    python -m course_lib.observability.gpu_monitor --json       # the same figures as JSON, for a job's log

The figures come from NVML, the library nvidia-smi itself reads, through the `pynvml` module (pip package
nvidia-ml-py) when it is installed; otherwise from `nvidia-smi --query-gpu=... --format=csv`. Both ignore
CUDA_VISIBLE_DEVICES: they list every GPU the process can reach (all of the node's, unless a scheduler's
cgroup or a container hides some), numbered in PCI bus order. torch_memory() adds what PyTorch's
caching allocator holds in *this* process: allocated (live tensors), reserved (allocated + cached free blocks),
their peaks, and reserved - allocated: memory the allocator holds that no tensor uses (its cache, and the
fragments that fragmentation leaves).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

MIB = 2**20
QUERY_FIELDS = ("index", "pci.bus_id", "name", "memory.used", "memory.total", "utilization.gpu",
                "utilization.memory", "temperature.gpu", "power.draw", "power.limit", "driver_version")
NVIDIA_SMI_TIMEOUT_S = 30
_UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": MIB, "GiB": 2**30}
_NUMBER = re.compile(r"^([-+]?\d+(?:\.\d+)?)\s*([A-Za-z%]*)$")


@dataclass(frozen=True)
class GPUStat:
    """One GPU. None means the driver does not report that figure for this card ('[N/A]', '[Not Supported]')."""

    index: int
    name: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_gpu_pct: float | None     # % of the last sample period in which any kernel was running
    utilization_memory_pct: float | None  # % of that period in which device memory was read or written
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    pci_bus_id: str | None = None


@dataclass(frozen=True)
class GPUSnapshot:
    """Every NVIDIA GPU of the node at one moment. Empty `gpus` means none was found; `reason` says why."""

    gpus: list[GPUStat] = field(default_factory=list)
    source: str | None = None             # 'nvml' or 'nvidia-smi'
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # the newest CUDA the driver supports (NVML only)
    reason: str = ""

    def __bool__(self) -> bool:
        return bool(self.gpus)


# ------------------------------------------------------------------------------------------------ nvidia-smi
def _value(text: str, header_unit: str | None):
    """'81920 MiB' -> bytes, '35 %' -> 35.0, '62.45 W' -> 62.45, '[N/A]' -> None; plain text stays text."""
    text = text.strip()
    if not text or text.strip("[]") in ("N/A", "Not Supported", "Unknown Error", "Insufficient Permissions",
                                        "GPU requires reset", "Not Available"):
        return None
    match = _NUMBER.match(text)
    if not match:
        return text
    number, unit = float(match.group(1)), match.group(2) or header_unit or ""
    return int(number * _UNIT_BYTES[unit]) if unit in _UNIT_BYTES else number


def _csv_records(text: str) -> list[dict]:
    """One {field: value} per GPU line; numbers converted with the unit of the value or of the header."""
    rows = list(csv.reader(io.StringIO(text.strip()), skipinitialspace=True))
    if not rows or "index" not in [cell.split(" [")[0].strip() for cell in rows[0]]:
        raise ValueError("nvidia-smi CSV output must start with a header line naming the fields (including 'index'); "
                         f"got {text[:80]!r}")
    header = []
    for cell in rows[0]:
        name, _, unit = cell.strip().partition(" [")
        header.append((name.strip(), unit.rstrip("]") or None))
    records = []
    for line_no, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(f"nvidia-smi CSV line {line_no} has {len(row)} fields, the header {len(header)}: {row}")
        records.append({name: _value(cell, unit) for (name, unit), cell in zip(header, row)})
    return records


def parse_nvidia_smi_csv(text: str) -> list[GPUStat]:
    """GPUs from `nvidia-smi --query-gpu=<fields> --format=csv` output (with or without units, in any field order).

    The header line names the fields, with units in brackets ('memory.used [MiB]'); values may carry the unit
    themselves ('1234 MiB') or not (`--format=csv,nounits`). Fields the query did not ask for are None.
    """
    gpus = []
    for values in _csv_records(text):
        def number(key):
            value = values.get(key)
            return value if isinstance(value, (int, float)) else None

        def whole(key):
            value = number(key)
            return None if value is None else int(value)

        bus_id = values.get("pci.bus_id")
        gpus.append(GPUStat(index=int(values["index"]), name=str(values.get("name") or "unknown"),
                            memory_used_bytes=whole("memory.used"), memory_total_bytes=whole("memory.total"),
                            utilization_gpu_pct=number("utilization.gpu"),
                            utilization_memory_pct=number("utilization.memory"),
                            temperature_c=number("temperature.gpu"), power_w=number("power.draw"),
                            power_limit_w=number("power.limit"),
                            pci_bus_id=bus_id if isinstance(bus_id, str) else None))
    return gpus


def _from_nvidia_smi(executable: str) -> GPUSnapshot:
    path = shutil.which(executable)
    if path is None:
        return GPUSnapshot(reason=f"{executable} is not on PATH")
    command = [path, f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return GPUSnapshot(reason=f"{executable} could not run: {error}")
    if done.returncode != 0:
        message = " ".join((done.stdout + done.stderr).split()) or "no output"
        return GPUSnapshot(reason=f"{executable} exited with code {done.returncode}: {message}")
    gpus = parse_nvidia_smi_csv(done.stdout)
    if not gpus:
        return GPUSnapshot(reason=f"{executable} listed no GPUs")
    driver = _csv_records(done.stdout)[0].get("driver_version")
    return GPUSnapshot(gpus=gpus, source="nvidia-smi", driver_version=None if driver is None else str(driver))


# ----------------------------------------------------------------------------------------------------- NVML
def _from_nvml() -> GPUSnapshot:
    try:
        import pynvml  # nvidia-ml-py: imported only here, so the course needs it only on GPU machines
    except ImportError:
        return GPUSnapshot(reason="pynvml (pip package nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as error:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no usable driver
        return GPUSnapshot(reason=f"NVML could not start: {error}")
    try:
        def read(call, *args, scale=None):
            try:
                value = call(*args)
            except Exception:  # NVMLError_NotSupported for this card or field
                return None
            return value if scale is None else value * scale

        def text(value):
            return value.decode() if isinstance(value, bytes) else str(value)

        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                used, total = int(memory.used), int(memory.total)
            except Exception:
                used = total = None
            try:
                rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
                util_gpu, util_mem = float(rates.gpu), float(rates.memory)
            except Exception:
                util_gpu = util_mem = None
            try:
                bus_id = text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            except Exception:
                bus_id = None
            gpus.append(GPUStat(
                index=index, name=text(pynvml.nvmlDeviceGetName(handle)), memory_used_bytes=used,
                memory_total_bytes=total, utilization_gpu_pct=util_gpu, utilization_memory_pct=util_mem,
                temperature_c=read(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
                power_w=read(pynvml.nvmlDeviceGetPowerUsage, handle, scale=1e-3),  # NVML reports milliwatts
                power_limit_w=read(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle, scale=1e-3), pci_bus_id=bus_id))
        driver = read(lambda: text(pynvml.nvmlSystemGetDriverVersion()))
        cuda = read(pynvml.nvmlSystemGetCudaDriverVersion)  # 12040 means CUDA 12.4
        cuda_text = None if cuda is None else f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}"
        if not gpus:
            return GPUSnapshot(reason="NVML started but found no GPUs")
        return GPUSnapshot(gpus=gpus, source="nvml", driver_version=driver, cuda_driver_version=cuda_text)
    finally:
        pynvml.nvmlShutdown()


def gpu_snapshot(*, use_nvml: bool = True, nvidia_smi: str = "nvidia-smi") -> GPUSnapshot:
    """Every NVIDIA GPU of the node, from NVML if pynvml is importable, else from nvidia-smi.

    With no GPU, returns an empty snapshot whose `reason` names what was tried and why it failed.
    """
    reasons = []
    if use_nvml:
        snapshot = _from_nvml()
        if snapshot:
            return snapshot
        reasons.append(snapshot.reason)
    snapshot = _from_nvidia_smi(nvidia_smi)
    if snapshot:
        return snapshot
    reasons.append(snapshot.reason)
    return GPUSnapshot(reason="; ".join(reasons))


# ---------------------------------------------------------------------------------------- torch's allocator
def summarise_allocator(stats: Mapping) -> dict:
    """The figures that matter from torch.cuda.memory_stats(): bytes now and at peak, and fragmentation signs.

    fragmentation = reserved - allocated: memory the caching allocator holds but no tensor uses. Part of it is
    reusable cache; the part inside split blocks (inactive_split_bytes) fits only small enough requests.
    alloc_retries counts cudaMalloc failures that forced the allocator to free its cache and retry: a job that
    is fragmenting its memory.
    """
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    return {"allocated": allocated, "reserved": reserved,
            "max_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
            "max_reserved": int(stats.get("reserved_bytes.all.peak", 0)),
            "fragmentation": reserved - allocated,
            "inactive_split": int(stats.get("inactive_split_bytes.all.current", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)), "ooms": int(stats.get("num_ooms", 0))}


def torch_memory(device=None) -> dict | None:
    """summarise_allocator() for a CUDA device of this process, or None when torch has no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    return summarise_allocator(torch.cuda.memory_stats(device))


# ------------------------------------------------------------------------------------------------------ CLI
def _fmt(value, unit: str = "", digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _mib(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else n_bytes / MIB


def format_snapshot(snapshot: GPUSnapshot) -> str:
    """The snapshot as a text table (MiB, as nvidia-smi prints memory), or the no-GPU message."""
    if not snapshot:
        return f"no NVIDIA GPU found ({snapshot.reason})"
    lines = [f"source: {snapshot.source}; driver {snapshot.driver_version or '?'}"
             + (f", supports CUDA up to {snapshot.cuda_driver_version}" if snapshot.cuda_driver_version else ""),
             f"{'gpu':<4}{'name':<28}{'memory used / total':>22}{'util':>6}{'mem':>6}{'temp':>6}{'power / limit':>16}"]
    for g in snapshot.gpus:
        memory = f"{_fmt(_mib(g.memory_used_bytes))} / {_fmt(_mib(g.memory_total_bytes))} MiB"
        power = f"{_fmt(g.power_w)} / {_fmt(g.power_limit_w)} W"
        lines.append(f"{g.index:<4}{g.name[:27]:<28}{memory:>22}{_fmt(g.utilization_gpu_pct, '%'):>6}"
                     f"{_fmt(g.utilization_memory_pct, '%'):>6}{_fmt(g.temperature_c, 'C'):>6}{power:>16}")
    return "\n".join(lines)


def allocator_line(device=None) -> str:
    """One log line of torch_memory(device), for a training loop to print every N steps (in MiB)."""
    stats = torch_memory(device)
    if stats is None:
        return "torch allocator: no CUDA device in this process"
    mib = {key: value / MIB for key, value in stats.items()}
    return (f"torch allocator: allocated {mib['allocated']:.0f} MiB, reserved {mib['reserved']:.0f} MiB, "
            f"peak allocated {mib['max_allocated']:.0f} MiB, reserved - allocated {mib['fragmentation']:.0f} MiB, "
            f"alloc retries {stats['alloc_retries']}, OOMs {stats['ooms']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="repeat every SECONDS")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi executable to fall back on")
    parser.add_argument("--no-nvml", action="store_true", help="skip NVML even if pynvml is installed")
    args = parser.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        parser.error(f"--watch must be a positive number of seconds, got {args.watch}")
    while True:
        snapshot = gpu_snapshot(use_nvml=not args.no_nvml, nvidia_smi=args.nvidia_smi)
        if args.json:
            print(json.dumps({**asdict(snapshot), "time": time.time()}), flush=True)
        else:
            if args.watch is not None:
                print(time.strftime("%Y-%m-%d %H:%M:%S"))
            print(format_snapshot(snapshot), flush=True)
        if args.watch is None or not snapshot:
            return 0 if snapshot else 1
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())

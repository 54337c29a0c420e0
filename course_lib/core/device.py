"""Which device to train on and which low-precision dtype autocast should use there.

Devices are picked cuda > mps > cpu. Precision is one of "auto", "fp32", "bf16", "fp16":

- "auto": bf16 on a CUDA card that supports it (Ampere and newer), else fp16 on CUDA; fp32 on CPU and MPS.
- "bf16": autocast to bfloat16. Same exponent range as fp32, so no loss scaling is needed.
- "fp16": autocast to float16 with a GradScaler; CUDA only (the small exponent range needs loss scaling,
  and the course only supports the scaler on CUDA). Asking for it elsewhere raises an error.
- "fp32": no autocast.

Why bf16 is opt-in on CPU: its speed depends on the instruction set. With AVX512-BF16 (or AMX) the matmuls
run natively; without it they are emulated, which can make them slower than fp32. Measure on your machine:

    python -m course_lib.core.device                        # prints the chosen device and autocast dtype
    python -m course_lib.precision.comparison               # fp32, bf16 and fp16 runs, interleaved, step times too

On a 2-core AMD EPYC with AVX512-BF16 (1 thread), bf16 was no faster than fp32 for the
tiny preset (its 64-wide matrices leave the casts as the main cost) and about a quarter faster for the small
preset; the comparison prints the times for your CPU. fp32 stays the CPU default: it is the reference precision,
and without native bf16 support it is the safer bet for speed too.
"""

from __future__ import annotations

import argparse
import contextlib

import torch


PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")
DEVICE_CHOICES = ("auto", "cuda", "mps", "cpu")


def mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


_MPS_SAID = []


def _say_mps_once() -> None:
    """On a Mac, device='auto' takes the Apple GPU: say so where it happens (once per process), and what differs."""
    if not _MPS_SAID:
        _MPS_SAID.append(True)
        print("device='auto' chose mps, this Mac's GPU, for this one-process run; the course's multi-rank runs use "
              "CPU ranks over gloo, and figures in the book were measured on the CPU: pass device='cpu' to match "
              "them", flush=True)


def select_device(preference: str = "auto") -> torch.device:
    """'auto' picks cuda > mps > cpu. An explicit 'cuda' or 'mps' that is not available raises RuntimeError.

    'cuda:1' style indices are accepted as well.
    """
    preference = str(preference)
    kind = preference.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES} (optionally 'cuda:N'), got {preference!r}")
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            _say_mps_once()
            return torch.device("mps")
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {preference!r} was requested but CUDA is not available "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use --device auto or cpu"
        )
    if kind == "mps" and not mps_available():
        raise RuntimeError(f"device {preference!r} was requested but MPS (Apple GPU) is not available; use cpu")
    return torch.device(preference)


def autocast_dtype(device: torch.device | str, precision: str = "auto") -> torch.dtype | None:
    """The dtype autocast should use on `device`, or None for plain fp32 (see the module docstring)."""
    device = torch.device(device)
    if precision not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {precision!r}")
    if precision == "fp32":
        return None
    if precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(
            f"precision 'fp16' needs CUDA (it trains with a GradScaler), but the device is {device.type!r}; "
            "use precision 'bf16' (no scaler needed) or 'fp32'"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("precision 'bf16' was requested but this CUDA card does not support bfloat16; use 'fp16'")
    return torch.bfloat16 if precision == "bf16" else torch.float16


def autocast_context(device: torch.device | str, dtype: torch.dtype | None):
    """torch.autocast for (device, dtype); a no-op context when dtype is None (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def needs_grad_scaler(device: torch.device | str, dtype: torch.dtype | None) -> bool:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 do not need it."""
    return dtype == torch.float16 and torch.device(device).type == "cuda"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print the selected device and autocast dtype.")
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    parser.add_argument("--precision", default="auto", choices=PRECISION_CHOICES)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = select_device(args.device)
    dtype = autocast_dtype(device, args.precision)
    print(f"device: {device}; autocast dtype: {dtype or 'none (fp32)'}; "
          f"GradScaler: {needs_grad_scaler(device, dtype)}")


if __name__ == "__main__":
    main()

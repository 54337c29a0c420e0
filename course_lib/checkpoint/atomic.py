"""Checkpoints that survive a crash: everything needed to resume exactly, written atomically.

A checkpoint holds the model weights and config, the optimizer, LR scheduler and GradScaler states, every
random number generator (Python, NumPy, torch CPU, CUDA / MPS when present), the step and the data
loader's position. Resuming from it in a new process continues the run bit for bit.

Atomic write: torch.save goes to a temporary file in the same directory, which is flushed and fsync'ed,
then os.replace()d onto the final name, and the directory is fsync'ed. A process killed at any moment
leaves either the old file or the new one under the final name, never half of one.

Naming in a run directory: the trainer writes `ckpt_step{N:06d}.pt`, then points `latest.pt` at it by
hard-linking it to a temporary name and os.replace()ing that onto `latest.pt` (atomic and no extra disk
space; where hard links are not supported the bytes are copied to the temporary file instead).
`keep_last` prunes old `ckpt_step*.pt` files; `latest.pt` stays valid because it is its own link.

Only tensors and plain Python values are stored, so checkpoints load with torch.load(weights_only=True),
which cannot run code hidden in a file. Inspect one with:

    python -m course_lib.checkpoint.atomic runs/tiny/latest.pt
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

FORMAT = "course_lib.checkpoint.atomic"
FORMAT_VERSION = 1
LATEST = "latest.pt"
_CKPT_RE = re.compile(r"^ckpt_step(\d+)\.pt$")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP-style wrappers (`.module`) and torch.compile (`._orig_mod`)."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def get_rng_state() -> dict:
    """Every generator a training step may draw from (dropout, sampling, shuffles), as plain values."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        else:
            warnings.warn(f"checkpoint has CUDA RNG states for {len(state['cuda'])} devices but "
                          f"{torch.cuda.device_count()} are visible; CUDA RNG not restored")
    if "mps" in state and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"].cpu())


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable. Not possible on every OS (Windows cannot open a directory).
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | os.PathLike, write_fn) -> Path:
    """Call write_fn(binary_file) on a temp file next to `path`, fsync it, then os.replace it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def save_checkpoint(path, *, model: nn.Module, optimizer=None, scheduler=None, scaler=None, step: int,
                    data_state=None, extra: dict | None = None) -> Path:
    """Write a checkpoint atomically to `path`; returns the path. `extra` must hold plain values/tensors."""
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),  # TorchVersion is not weights_only-safe
        "step": int(step),
        "model": model.state_dict(),
        "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "rng": get_rng_state(),
        "data_state": data_state,
        "extra": extra or {},
    }
    return atomic_write(path, lambda f: torch.save(payload, f))


def _describe(obj) -> str:
    if isinstance(obj, dict):
        keys = [str(k) for k in list(obj)[:5]]
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return f"a bare state_dict of {len(obj)} tensors (keys like {keys[:3]})"
        return f"a dict with keys {keys}{' ...' if len(obj) > 5 else ''}"
    if isinstance(obj, torch.Tensor):
        return f"a single tensor of shape {tuple(obj.shape)}"
    return f"an object of type {type(obj).__name__}"


def _read(path: Path, map_location) -> dict:
    if not path.is_file():
        hint = ""
        if path.parent.is_dir():
            found = sorted(p.name for p in path.parent.glob("*.pt"))
            hint = f"; .pt files in {path.parent}: {found}" if found else f"; no .pt files in {path.parent.resolve()}"
        raise FileNotFoundError(f"no checkpoint file at {path}{hint}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises RuntimeError / UnpicklingError / EOFError depending on the damage
        lines = str(err).strip().splitlines() or [type(err).__name__]
        first_line = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[0])
        raise ValueError(
            f"{path} ({path.stat().st_size:,} bytes) is not a readable course_lib checkpoint: torch.load "
            f"(weights_only=True) failed with {type(err).__name__}: {first_line}. Expected a file written by "
            "course_lib.checkpoint.atomic.save_checkpoint; a truncated or partly written file fails like this."
        ) from err
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a course_lib checkpoint: it holds {_describe(ckpt)}. Expected a dict with "
            f"'format': {FORMAT!r} written by course_lib.checkpoint.atomic.save_checkpoint "
            "(a bare state_dict loads with model.load_state_dict(torch.load(path)))."
        )
    if ckpt.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format version {ckpt['format_version']}, newer than this "
                         f"course_lib understands ({FORMAT_VERSION}); update course_lib")
    return ckpt


def _load_model_state(model: nn.Module, ckpt: dict, path: Path) -> None:
    model = unwrap_model(model)
    expected, saved = model.state_dict(), ckpt["model"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in expected if k in saved and saved[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        problems = [f"missing keys (in the model, not in the checkpoint): {missing}" if missing else "",
                    f"unexpected keys (in the checkpoint, not in the model): {unexpected}" if unexpected else "",
                    f"shape mismatches: {shapes}" if shapes else ""]
        config = getattr(model, "config", None)
        saved_config, model_config = ckpt.get("model_config"), config.to_dict() if hasattr(config, "to_dict") else None
        if saved_config and model_config:
            diff = {k: (saved_config.get(k), v) for k, v in model_config.items() if saved_config.get(k) != v}
            problems.append(f"config differences as (checkpoint, model): {diff}")
        raise ValueError(f"checkpoint {path} does not fit the model:\n  " + "\n  ".join(p for p in problems if p))
    model.load_state_dict(saved)


def load_checkpoint(path, *, model=None, optimizer=None, scheduler=None, scaler=None, restore_rng: bool = True,
                    map_location="cpu") -> dict:
    """Load `path` into whichever of model / optimizer / scheduler / scaler are given; returns the dict.

    The returned dict has 'step', 'data_state', 'model_config', 'extra' and the raw states. RNG states
    are restored last, so nothing done while loading disturbs them.
    """
    path = Path(path)
    ckpt = _read(path, map_location)
    if model is not None:
        _load_model_state(model, ckpt, path)
    for name, target in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if target is None or (name == "scaler" and not target.is_enabled()):
            continue
        if ckpt.get(name) is None:
            raise ValueError(f"checkpoint {path} has no {name} state, but a {name} was passed to load it into")
        target.load_state_dict(ckpt[name])
    if restore_rng:
        set_rng_state(ckpt["rng"])
    return ckpt


def checkpoint_path(directory, step: int) -> Path:
    return Path(directory) / f"ckpt_step{step:06d}.pt"


def list_checkpoints(directory) -> list[Path]:
    """ckpt_step*.pt files in `directory`, oldest step first (temp files and latest.pt excluded)."""
    directory = Path(directory)
    found = [(int(m.group(1)), p) for p in directory.glob("ckpt_step*.pt") if (m := _CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory) -> Path | None:
    """`directory/latest.pt` if present, else the highest-step ckpt_step*.pt, else None."""
    directory = Path(directory)
    if (directory / LATEST).is_file():
        return directory / LATEST
    found = list_checkpoints(directory)
    return found[-1] if found else None


def resolve_resume(resume, directory, *, latest=None,
                   kind: str = "checkpoint (latest.pt or ckpt_step*.pt)") -> Path | None:
    """The checkpoint a run should resume from: resume=False -> None; True -> directory's latest (error if
    none); 'auto' -> directory's latest or None; a path -> that path. latest(directory) finds the newest
    (default latest_checkpoint); kind names what it looks for in the error."""
    if resume is False:
        return None
    if resume is True or resume == "auto":
        found = (latest or latest_checkpoint)(directory)
        if found is None and resume is True:
            raise FileNotFoundError(f"resume=True but {directory} holds no {kind}; "
                                    "use resume='auto' to start fresh when there is none")
        return found
    return Path(resume)


def _point_latest(target: Path) -> Path:
    latest = target.parent / LATEST
    fd, tmp = tempfile.mkstemp(prefix=f".{LATEST}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        os.link(target, tmp)
    except OSError:  # no hard links here (some network / FAT filesystems): copy the bytes instead
        def copy(f):
            with open(target, "rb") as source:
                shutil.copyfileobj(source, f)
        return atomic_write(latest, copy)
    os.replace(tmp, latest)
    _fsync_dir(target.parent)
    return latest


def save_training_checkpoint(directory, *, step: int, keep_last: int | None = None, **state) -> Path:
    """save_checkpoint to directory/ckpt_step{step:06d}.pt, point latest.pt at it, prune to keep_last files."""
    path = save_checkpoint(checkpoint_path(directory, step), step=step, **state)
    _point_latest(path)
    if keep_last is not None:
        for old in list_checkpoints(directory)[:-keep_last] if keep_last > 0 else list_checkpoints(directory):
            old.unlink(missing_ok=True)
    return path


def remove_partial_files(directory) -> list[Path]:
    """Delete temp files that a killed save left behind in `directory` (call before any save starts)."""
    stale = [p for p in Path(directory).glob(".*.tmp") if p.name.startswith((".ckpt_step", f".{LATEST}."))]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def clear_checkpoints(directory) -> list[Path]:
    """Delete latest.pt and every ckpt_step*.pt in `directory` (a fresh run replacing an earlier one)."""
    removed = list_checkpoints(directory) + [p for p in [Path(directory) / LATEST] if p.exists()]
    for p in removed:
        p.unlink()
    return removed


EARLIER_RUNS = "earlier_runs"
RUN_FILES = ("metrics.jsonl", "tb", "latest.dcp")
"""What a training run writes next to its checkpoints (course_lib.core.metrics; the pointer to its newest
distributed checkpoint, course_lib.checkpoint.distributed): moved with them."""


def move_earlier_run(directory) -> Path | None:
    """Move an earlier run's checkpoints, metrics and TensorBoard logs out of the way, into
    directory/earlier_runs/<time>/, and return that folder (None if there was nothing to move).

    A fresh run in a run directory must not resume the old run's latest.pt by accident, and must not delete it
    either: nothing is lost, and the earlier run stays readable (evaluate.py, read_metrics) where it went.
    """
    directory = Path(directory)
    found = list_checkpoints(directory) + sorted(directory.glob("ckpt_step*.dcp")) + [
        p for p in [directory / LATEST, *(directory / f for f in RUN_FILES)] if p.exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = directory / EARLIER_RUNS / stamp
    n = 1
    while target.exists():
        n += 1
        target = directory / EARLIER_RUNS / f"{stamp}-{n}"
    target.mkdir(parents=True)
    for path in found:
        os.replace(path, target / path.name)
    return target


def main(argv=None):
    parser = argparse.ArgumentParser(description="Summarise a course_lib checkpoint.")
    parser.add_argument("path", help="a checkpoint file, or a run directory (uses its latest checkpoint)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise SystemExit(f"no checkpoints in {path}")
        path = found
    ckpt = load_checkpoint(path, restore_rng=False)
    n_params = sum({t.data_ptr(): t.numel() for t in ckpt["model"].values()}.values())  # tied tensors once
    print(f"{path}: step {ckpt['step']}, {n_params:,} parameters, torch {ckpt['torch_version']}")
    print(f"model config: {ckpt['model_config']}")
    states = [k for k in ("optimizer", "scheduler", "scaler", "data_state") if ckpt.get(k) is not None]
    print(f"states: {', '.join(states) or 'model only'}")
    if ckpt["extra"]:
        print(f"extra: {sorted(ckpt['extra'])}")


if __name__ == "__main__":
    main()

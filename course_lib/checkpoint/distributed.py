"""Distributed checkpoints of sharded layouts (ZeRO, tensor and pipeline parallelism) with torch.distributed.checkpoint.

Every rank writes its own shards in parallel; a tensor that several ranks hold (a replicated norm, a data-parallel
copy) is written once. A checkpoint is a folder:

    out_dir/ckpt_step000100.dcp/     .metadata + __<rank>_0.distcp files (DCP), meta.pt (step, schedule,
                                     data position, RNG, train config, the layout's name; written by rank 0)
    out_dir/latest.dcp               a text file naming the newest folder (replaced atomically)

The folder is written under a temporary name and renamed by rank 0 once every rank has finished, so a job that
dies while saving leaves the previous checkpoint as it was. Resuming needs the same layout (the shards are cut
for it); `meta.pt` names the layout that wrote it, and a different one is refused before anything is loaded.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from course_lib.checkpoint.atomic import _fsync_dir, atomic_write, get_rng_state, resolve_resume, set_rng_state

LATEST = "latest.dcp"
META = "meta.pt"
_DIR_RE = re.compile(r"^ckpt_step(\d+)\.dcp$")


def checkpoint_dir(directory, step: int) -> Path:
    return Path(directory) / f"ckpt_step{step:06d}.dcp"


def list_distributed_checkpoints(directory) -> list[Path]:
    """Complete checkpoint folders in `directory` (with their meta.pt), oldest step first."""
    found = [(int(m.group(1)), p) for p in Path(directory).glob("ckpt_step*.dcp")
             if (m := _DIR_RE.match(p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


def latest_distributed_checkpoint(directory) -> Path | None:
    """The folder latest.dcp names, else the highest step's, else None."""
    directory = Path(directory)
    pointer = directory / LATEST
    if pointer.is_file():
        named = directory / pointer.read_text().strip()
        if (named / META).is_file():
            return named
    found = list_distributed_checkpoints(directory)
    return found[-1] if found else None


def resolve_distributed_resume(resume, directory) -> Path | None:
    """course_lib.checkpoint.atomic.resolve_resume for checkpoint folders; a path must be one (with its meta.pt)."""
    path = resolve_resume(resume, directory, latest=latest_distributed_checkpoint,
                          kind="distributed checkpoint (latest.dcp or ckpt_step*.dcp/)")
    if path is not None and not (path / META).is_file():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint folder (no {META} in it): a sharded "
                                "layout resumes from a ckpt_step*.dcp folder written by the same layout")
    return path


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_distributed_checkpoint(directory, *, step: int, state: dict, layout: str, scheduler=None, scaler=None,
                                data_state=None, extra: dict | None = None, keep_last: int | None = None) -> Path:
    """Every rank calls it with its own `state` (tensors and DTensors, e.g. Parallelized.state_dict()).

    Returns the checkpoint folder. keep_last: keep only this many folders (the newest)."""
    directory = Path(directory)
    final = checkpoint_dir(directory, step)
    partial = directory / f".{final.name}.tmp"
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)  # what a job killed while saving this step left behind
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(partial))
    if _is_main():
        meta = {"step": int(step), "layout": layout, "torch_version": str(torch.__version__),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
                "rng": get_rng_state(), "data_state": data_state, "extra": extra or {}}
        atomic_write(partial / META, lambda f: torch.save(meta, f))
    _barrier()  # every rank's shards are on disk before the folder gets its final name
    if _is_main():
        if final.exists():  # the same step saved again (a resumed run): the new one replaces it whole
            old = directory / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old)
        else:
            os.replace(partial, final)
        _fsync_dir(directory)
        atomic_write(directory / LATEST, lambda f: f.write(final.name.encode()))
        if keep_last is not None:
            for old in list_distributed_checkpoints(directory)[:-keep_last] if keep_last > 0 else []:
                shutil.rmtree(old)
    _barrier()
    return final


def load_distributed_checkpoint(path, *, state: dict, layout: str, scheduler=None, scaler=None,
                                restore_rng: bool = True) -> dict:
    """Fill `state` (as this rank's save passed it) from the folder `path`; restore scheduler, scaler and RNG.

    Returns the meta dict ('step', 'data_state', 'extra', ...). A folder written by another layout is refused."""
    path = Path(path)
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    if meta["layout"] != layout:
        raise ValueError(f"{path} was written by the layout {meta['layout']!r}; this run is {layout!r}: resume "
                         "with the same layout (its shards are cut for it)")
    dcp.load(state, checkpoint_id=str(path))
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None and meta.get(name) is not None and (name != "scaler" or target.is_enabled()):
            target.load_state_dict(meta[name])
    if restore_rng:
        set_rng_state(meta["rng"])
    return meta

"""Rank workers that grade Session C's checkpoint exercise: the learner's ranked save on every rank.

    ranks = launch(check_ranked_save, 3, args=(spawnable(save_ranked), str(directory)))

The worker records, per rank, every torch.save (the file and the tensor's size) and every rename onto a file
(the atomic write of the manifest), and makes one rank slow to write its shard, so that a manifest written
before the other ranks are done shows up in the files' modification times. Rank 0 also reports each file's
size on disk: torch.save of a slice writes the whole storage the slice views, so a shard saved without
.clone() holds every rank's numbers, which the tensor's numel does not show.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from course_lib.parity import seeded_gpt

SAVE_STEP = 7
SHARD_HEADER_BYTES = 4096
"""Bytes torch.save adds around one 1-D tensor's data (its zip container, the pickle, alignment): 1,549 to
1,605 measured with torch 2.13 for shards named shard_0000r.pt; 4 KiB leaves room for other versions."""


def saved_model(seed: int = 0):
    """The model every rank holds when it saves (identical replicas, as in data parallelism)."""
    return seeded_gpt(seed + 7, "tiny")


def check_ranked_save(save_fn, directory: str, *, slow_rank: int = 1, delay_s: float = 0.3, seed: int = 0) -> dict:
    """Worker: save_fn(directory, model, step) on every rank; returns what this rank saved and renamed."""
    rank = dist.get_rank()
    model = saved_model(seed)
    saves, renames = [], []
    real_save, real_replace, real_rename = torch.save, os.replace, os.rename

    def recording_save(obj, f, *args, **kwargs):
        if rank == slow_rank:
            time.sleep(delay_s)  # a slow file system: this rank's shard lands last
        numel = obj.numel() if isinstance(obj, torch.Tensor) else None
        if isinstance(obj, dict):
            numel = sum(v.numel() for v in obj.values() if isinstance(v, torch.Tensor))
        saves.append({"path": os.fspath(f) if isinstance(f, (str, os.PathLike)) else None, "numel": numel})
        return real_save(obj, f, *args, **kwargs)

    def recording(real):
        def rename(src, dst, *args, **kwargs):
            renames.append({"src": os.fspath(src), "dst": os.fspath(dst)})
            return real(src, dst, *args, **kwargs)
        return rename

    error = None
    with mock.patch.object(torch, "save", recording_save), mock.patch.object(os, "replace", recording(real_replace)), \
            mock.patch.object(os, "rename", recording(real_rename)):
        try:
            save_fn(directory, model, SAVE_STEP)
        except Exception as err:  # noqa: BLE001 (reported to the test cell)
            error = f"{type(err).__name__}: {err}"
    dist.barrier()  # every rank has returned: the directory is complete if the save was right
    paths = list(Path(directory).iterdir()) if rank == 0 and Path(directory).is_dir() else []
    files = {p.name: p.stat().st_mtime_ns for p in paths}
    sizes = {p.name: p.stat().st_size for p in paths}
    return {"rank": rank, "error": error, "saves": saves, "renames": renames, "files": files, "sizes": sizes}

"""The worker that grades the ranked-checkpoint exercise (Session C, notebook 03b) sees what a shard file holds.

    .venv/bin/python -m pytest -q tests/checkpoint/test_exercise_workers.py

torch.save of a slice writes the whole storage the slice views: the tensor's numel is the shard's, the file is
the whole model's. Only the size on disk tells them apart, within the header torch.save adds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from course_lib.checkpoint.workers import SHARD_HEADER_BYTES, check_ranked_save, saved_model
from course_lib.runtime.launch import launch


@pytest.mark.parametrize("numel", [1, 100, 43_700, 131_099, 394_496])
def test_the_header_allowance_holds_a_shard_and_not_a_whole_storage(tmp_path, numel):
    for rank in range(4):
        path = tmp_path / f"shard_{rank:05d}.pt"
        torch.save(torch.randn(numel), path)
        assert 0 < path.stat().st_size - 4 * numel <= SHARD_HEADER_BYTES
        whole = torch.randn(numel + SHARD_HEADER_BYTES)  # the shard plus 16 KiB of other ranks' numbers
        torch.save(whole[rank:rank + numel], path)  # a view: its whole storage is written
        assert path.stat().st_size > 4 * numel + SHARD_HEADER_BYTES


def _save_shard(directory, model, step, clone):
    """Step 3 of the exercise's format only (the shard files): with or without .clone()."""
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shard = math.ceil(flat.numel() / world_size)
    padded = torch.cat([flat, flat.new_zeros(shard * world_size - flat.numel())])
    mine = padded[rank * shard:(rank + 1) * shard]
    torch.save(mine.clone() if clone else mine, directory / f"shard_{rank:05d}.pt")


def save_cloned(directory, model, step):
    _save_shard(directory, model, step, clone=True)


def save_view(directory, model, step):
    _save_shard(directory, model, step, clone=False)


@pytest.mark.distributed
def test_the_worker_reports_each_file_size(tmp_path):
    numel = sum(p.numel() for p in saved_model().parameters())
    shard_bytes = 4 * math.ceil(numel / 3)
    results = {}
    for save in (save_cloned, save_view):
        ranks = launch(check_ranked_save, 3, args=(save, str(tmp_path / save.__name__)), log_dir=tmp_path / "logs",
                       timeout_s=60, threads_per_rank=1, echo=False)
        assert all(r["error"] is None for r in ranks), [r["error"] for r in ranks]
        assert [s["numel"] for r in ranks for s in r["saves"]] == [shard_bytes // 4] * 3  # numel cannot tell
        results[save.__name__] = ranks[0]["sizes"]
    assert sorted(results["save_cloned"]) == [f"shard_{r:05d}.pt" for r in range(3)]
    assert all(shard_bytes <= size <= shard_bytes + SHARD_HEADER_BYTES for size in results["save_cloned"].values())
    assert all(size >= 3 * shard_bytes for size in results["save_view"].values())  # every rank wrote everything

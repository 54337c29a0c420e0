"""Ranked checkpoints: N ranks write shards, rank 0 the manifest; same-size load, refusal and reshard."""

import pytest
import torch

from course_lib.checkpoint.ranked import load_full_parameters, read_manifest, shard_bounds
from course_lib.checkpoint.workers import load_ranked, save_ranked, save_twice_dying
from course_lib.parity import seeded_gpt
from course_lib.runtime.launch import RankFailure, launch

pytestmark = pytest.mark.distributed


def test_shard_bounds_pad_evenly():
    assert [shard_bounds(10, r, 4)[:2] for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert shard_bounds(10, 0, 4)[2] == 12


def test_round_trip_refusal_and_reshard(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = launch(save_ranked, 4, args=(str(ckpt),), log_dir=tmp_path / "logs", echo=False)[0]
    manifest = read_manifest(ckpt)
    assert manifest["world_size"] == 4 and manifest["step"] == 7
    files = [s["file"] for s in manifest["shards"]]
    assert [f.split("-")[0] for f in files] == [f"rank_{r:05d}" for r in range(4)]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["manifest.json", *files])
    params, _ = load_full_parameters(ckpt)  # offline, no process group
    for name, tensor in saved.items():
        torch.testing.assert_close(params[name], tensor)

    same = launch(load_ranked, 4, args=(str(ckpt),), log_dir=tmp_path / "logs", echo=False)
    assert [r["extra"]["data_position"] for r in same] == [100, 101, 102, 103]  # each rank its own state
    for name, tensor in saved.items():
        torch.testing.assert_close(same[3]["params"][name], tensor)

    with pytest.raises(RankFailure, match="written by 4 ranks but is being loaded by 2"):
        launch(load_ranked, 2, args=(str(ckpt),), log_dir=tmp_path / "logs", echo=False)

    resharded = launch(load_ranked, 2, args=(str(ckpt),), kwargs={"reshard": True}, log_dir=tmp_path / "logs",
                       echo=False)
    assert all(r["resharded"] and r["extra"] == {} for r in resharded)
    for name, tensor in saved.items():
        torch.testing.assert_close(resharded[1]["params"][name], tensor)


def test_incomplete_or_damaged_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    launch(save_ranked, 2, args=(str(ckpt),), log_dir=tmp_path / "logs", echo=False)
    shard = ckpt / read_manifest(ckpt)["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ValueError, match="does not match the manifest"):
        load_full_parameters(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json .* the save was interrupted"):
        read_manifest(ckpt)


@pytest.mark.parametrize("die_at,dying_rank", [("shard", 1), ("manifest", 0)])
def test_a_save_killed_in_a_reused_directory_leaves_the_previous_checkpoint_loadable(tmp_path, die_at, dying_rank):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankFailure, match=f"rank {dying_rank}"):
        launch(save_twice_dying, 2, args=(str(ckpt), die_at, dying_rank), log_dir=tmp_path / "logs", echo=False,
               timeout_s=30)
    params, manifest = load_full_parameters(ckpt)  # verifies every shard against the manifest
    assert manifest["step"] == 1
    expected = dict(seeded_gpt(0, "tiny").named_parameters())
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, expected[name].detach(), rtol=0, atol=0)


def test_saving_again_into_a_directory_replaces_the_checkpoint_and_its_shards(tmp_path):
    ckpt = tmp_path / "ckpt"
    launch(save_ranked, 2, args=(str(ckpt),), kwargs={"step": 1}, log_dir=tmp_path / "logs", echo=False)
    first = set(p.name for p in ckpt.glob("rank_*.pt"))
    launch(save_ranked, 2, args=(str(ckpt),), kwargs={"step": 2, "seed": 1}, log_dir=tmp_path / "logs", echo=False)
    manifest = read_manifest(ckpt)
    assert manifest["step"] == 2
    assert {p.name for p in ckpt.glob("rank_*.pt")} == {s["file"] for s in manifest["shards"]}, "old shards were kept"
    assert not first & {s["file"] for s in manifest["shards"]}

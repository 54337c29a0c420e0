"""Distributed checkpoint folders (course_lib.checkpoint.distributed) in one process: what is written, what a
resume finds, what is refused. The layouts' own round trips on real ranks are in tests/parallel/test_layouts.py."""

from __future__ import annotations

import pytest
import torch

from course_lib.checkpoint.atomic import EARLIER_RUNS, move_earlier_run
from course_lib.checkpoint.distributed import (
    LATEST,
    latest_distributed_checkpoint,
    list_distributed_checkpoints,
    load_distributed_checkpoint,
    resolve_distributed_resume,
    save_distributed_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: expected


def state(value: float) -> dict:
    return {"model": {"w": torch.full((3, 2), value)}, "zero": {"shard0of1": {"exp_avg": torch.full((4,), -value)}}}


def test_save_keeps_the_newest_folders_and_points_latest_at_the_last(tmp_path):
    for step in (2, 4, 6):
        save_distributed_checkpoint(tmp_path, step=step, state=state(step), layout="dp2 zero1", keep_last=2,
                                    data_state={"position": step}, extra={"val_loss": None})
    assert [p.name for p in list_distributed_checkpoints(tmp_path)] == ["ckpt_step000004.dcp", "ckpt_step000006.dcp"]
    assert (tmp_path / LATEST).read_text() == "ckpt_step000006.dcp"
    target = state(0.0)
    meta = load_distributed_checkpoint(resolve_distributed_resume(True, tmp_path), state=target, layout="dp2 zero1")
    assert meta["step"] == 6 and meta["data_state"] == {"position": 6}
    torch.testing.assert_close(target, state(6.0))


def test_a_folder_a_killed_save_left_is_never_resumed(tmp_path):
    save_distributed_checkpoint(tmp_path, step=2, state=state(2), layout="tp2")
    (tmp_path / ".ckpt_step000004.dcp.tmp").mkdir()  # died before meta.pt and the rename
    (tmp_path / "ckpt_step000008.dcp").mkdir()  # no meta.pt: not a checkpoint
    (tmp_path / LATEST).unlink()
    assert latest_distributed_checkpoint(tmp_path).name == "ckpt_step000002.dcp"
    save_distributed_checkpoint(tmp_path, step=2, state=state(3), layout="tp2")  # the same step again: replaced whole
    target = state(0.0)
    load_distributed_checkpoint(tmp_path / "ckpt_step000002.dcp", state=target, layout="tp2")
    torch.testing.assert_close(target, state(3.0))


def test_another_layout_and_a_file_are_refused_by_name(tmp_path):
    folder = save_distributed_checkpoint(tmp_path, step=2, state=state(2), layout="pp2 1f1b m2")
    with pytest.raises(ValueError, match=r"written by the layout 'pp2 1f1b m2'; this run is 'pp2 gpipe m2'"):
        load_distributed_checkpoint(folder, state=state(0), layout="pp2 gpipe m2")
    with pytest.raises(FileNotFoundError, match="latest.pt is not a distributed checkpoint folder"):
        resolve_distributed_resume(str(tmp_path / "latest.pt"), tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no distributed checkpoint"):
        resolve_distributed_resume(True, tmp_path / "elsewhere")
    assert resolve_distributed_resume("auto", tmp_path / "elsewhere") is None


def test_a_fresh_run_moves_earlier_folders_aside(tmp_path):
    save_distributed_checkpoint(tmp_path, step=2, state=state(2), layout="dp2 zero3")
    moved = move_earlier_run(tmp_path)
    assert moved.parent == tmp_path / EARLIER_RUNS
    assert sorted(p.name for p in moved.iterdir()) == ["ckpt_step000002.dcp", LATEST]
    assert latest_distributed_checkpoint(tmp_path) is None and latest_distributed_checkpoint(moved) is not None

"""FSDP checkpoints (course_lib.checkpoint.fsdp): the full file gathered on rank 0 and the sharded DCP directory
both load into a plain one-process GPT that computes the sharded model's logits, and both resume training
exactly on the ranks.

    .venv/bin/python -m pytest -q tests/checkpoint/test_fsdp.py
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from course_lib.checkpoint.atomic import load_checkpoint
from course_lib.checkpoint.fsdp import load_sharded_checkpoint
from course_lib.core.model import GPT, GPTConfig
from course_lib.evaluation import load_model
from course_lib.runtime.launch import launch
from course_lib.sharding import fsdp_workers as fw


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two FULL_SHARD ranks train 2 steps, save both ways, resume from both; returns (rank results, directory)."""
    directory = tmp_path_factory.mktemp("fsdp_ckpt")
    ranks = launch(fw.fsdp_checkpoints, 2, kwargs=dict(directory=str(directory / "run"), steps=2),
                   log_dir=directory / "logs", threads_per_rank=1, timeout_s=120)
    return ranks, directory / "run"


def plain_tiny() -> GPT:
    torch.manual_seed(123)  # weights unlike the checkpoint's: loading must replace them
    return GPT(GPTConfig.from_preset("tiny")).eval()


@pytest.mark.slow
@pytest.mark.distributed
def test_full_checkpoint_loads_into_one_process(saved):
    ranks, run = saved
    assert ranks[0]["full_path"] and ranks[1]["full_path"] is None  # rank 0 writes, rank 1 only sends
    model = plain_tiny()
    ckpt = load_checkpoint(run / "full" / "latest.pt", model=model, restore_rng=False)
    assert ckpt["step"] == 2 and "rng" in ckpt
    with torch.no_grad():
        torch.testing.assert_close(model(ranks[0]["probe"])[0], ranks[0]["logits"])
    evaluated, what = load_model(run / "full")  # scripts/evaluate.py's loader
    torch.testing.assert_close(evaluated.state_dict(), model.state_dict())


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_checkpoint_loads_into_one_process_without_a_process_group(saved, tmp_path):
    ranks, run = saved
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "model_config.json"} <= set(ranks[0]["files"])
    model = load_sharded_checkpoint(run / "dcp", model=plain_tiny())
    with torch.no_grad():
        torch.testing.assert_close(model(ranks[0]["probe"])[0], ranks[0]["logits"])
    evaluated, what = load_model(run / "dcp")  # reads model_config.json next to the shards
    assert "torch.distributed.checkpoint" in what
    torch.testing.assert_close(evaluated.state_dict(), model.state_dict())
    dcp_to_torch_save(run / "dcp", tmp_path / "one_file.pt")  # torch's converter: one ordinary file
    converted = torch.load(tmp_path / "one_file.pt", weights_only=True)
    torch.testing.assert_close(converted["model"], model.state_dict())
    assert set(converted["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("source", ["full", "dcp"])
def test_resuming_from_either_checkpoint_continues_the_run_exactly(saved, source):
    ranks, _ = saved
    for rank in ranks:
        after = rank["after_one_more_step"]
        for name, param in after["trained"].items():
            torch.testing.assert_close(after[source][name], param, rtol=0, atol=0)


def test_missing_sharded_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no torch.distributed.checkpoint.*metadata"):
        load_sharded_checkpoint(tmp_path / "nothing", model=plain_tiny())

"""The training CLI under torchrun, `--strategy ddp` with one GPU per rank over NCCL, gives the losses of the
one-process CLI with the same global batch.

    pytest -m multigpu tests/multigpu/test_train_cli_nccl.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]
GLOBAL_BATCH, STEPS, EVAL_INTERVAL = 8, 10, 5


def run(args, cwd, env) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def losses(run_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """(train losses, validation losses) of a run's metrics.jsonl, in float32, the dtype they were computed in."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["kind"] == "train"]
    val = [r["val_loss"] for r in records if r["kind"] == "eval"]
    return torch.tensor(train, dtype=torch.float32), torch.tensor(val, dtype=torch.float32)


def test_torchrun_ddp_cli_equals_the_one_process_cli(multigpu, tmp_path):
    world_size = multigpu.world_size(2, 4, 8)  # the global batch of 8 rows splits over them
    device = multigpu.device_type
    common = ["--model_size", "tiny", "--dataset", "synthetic", "--max_steps", str(STEPS), "--warmup_steps", "2",
              "--eval_interval", str(EVAL_INTERVAL), "--eval_batches", "2", "--ckpt_interval", "0",
              "--device", device, "--precision", "fp32", "--no-progress", "--no-tensorboard"]
    if multigpu.on_cpu:
        common += ["--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k != "COURSE_BACKEND"}  # the default group: NCCL for CUDA tensors
    if not multigpu.on_cpu:
        env["NCCL_DEBUG"] = "INFO"  # NCCL says when it starts: the proof that the ranks used it

    one = run(["-m", "course_lib.train", *common, "--batch_size", str(GLOBAL_BATCH), "--out_dir", "one"],
              tmp_path, env)
    ranks = run(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                 "-m", "course_lib.train", *common, "--strategy", "ddp",
                 "--batch_size", str(GLOBAL_BATCH // world_size), "--out_dir", "ranks", "--log_dir", "rank_logs"],
                tmp_path, env)

    expected_device = "cpu" if multigpu.on_cpu else "cuda:0"
    assert f"on {expected_device} x {world_size} ranks" in ranks, ranks[-3000:]
    assert f"on {expected_device if multigpu.on_cpu else 'cuda'}" in one, one[-3000:]
    if not multigpu.on_cpu:
        assert "NCCL INFO" in ranks, "the ranks printed no NCCL line: did they run NCCL?\n" + ranks[-3000:]
    assert all((tmp_path / "rank_logs" / f"rank_{r}" / "train.log").exists() for r in range(world_size))
    (train_one, val_one), (train_ranks, val_ranks) = losses(tmp_path / "one"), losses(tmp_path / "ranks")
    assert len(train_one) == len(train_ranks) == STEPS and len(val_one) == len(val_ranks) == STEPS // EVAL_INTERVAL
    multigpu.assert_losses_close(train_ranks, train_one, where=f"train, {world_size} ranks vs one process")
    multigpu.assert_losses_close(val_ranks, val_one, where=f"validation, {world_size} ranks vs one process")

"""The DDP trainer and the Accelerate loop, from the command lines learners type, against one process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.checkpoint.atomic import LATEST, load_checkpoint
from course_lib.runtime.env import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMMON = ["--model_size", "tiny", "--max_steps", "5", "--dataset", "synthetic", "--eval_interval", "5",
          "--eval_batches", "2", "--warmup_steps", "2", "--no-progress", "--no-tensorboard"]


def run(args, cwd):
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(run_dir: Path) -> torch.Tensor:
    """Train then validation losses of a run, as float32: the dtype they were computed in (fp32 tolerances)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r["loss"] for r in records if r["kind"] == "train"] + [r["val_loss"] for r in records if r["kind"] == "eval"]
    return torch.tensor(values, dtype=torch.float32)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, global batch 8: the reference every data-parallel run must reproduce."""
    cwd = tmp_path_factory.mktemp("single")
    run([sys.executable, "-m", "course_lib.train", *COMMON, "--batch_size", "8", "--out_dir", "run"], cwd)
    return losses(cwd / "run")


def test_torchrun_two_ranks_equals_one_process_and_writes_rank_logs(tmp_path, single):
    run([BIN / "torchrun", "--nproc_per_node=2", ROOT / "scripts" / "ddp_simulation_train.py", *COMMON,
         "--batch_size", "4", "--out_dir", "run"], tmp_path)
    torch.testing.assert_close(losses(tmp_path / "run"), single)
    logs = [(tmp_path / "logs" / f"rank_{r}" / "train.log").read_text() for r in range(2)]
    local = [[line.split("local loss ")[1].split()[0] for line in log.splitlines() if "local loss" in line]
             for log in logs]
    assert local[0] and local[0] != local[1]  # each rank saw different rows
    assert "[rank 1/2]" in logs[1]


def test_torchrun_four_ranks(tmp_path, single):
    run([BIN / "torchrun", "--nproc_per_node=4", "-m", "course_lib.train", "--strategy", "ddp", *COMMON,
         "--batch_size", "2", "--out_dir", "run"], tmp_path)
    torch.testing.assert_close(losses(tmp_path / "run"), single)
    assert all((tmp_path / "logs" / f"rank_{r}" / "train.log").exists() for r in range(4))


def test_ddp_strategy_without_torchrun_is_one_rank(tmp_path, single):
    out = run([sys.executable, ROOT / "scripts" / "ddp_simulation_train.py", *COMMON, "--batch_size", "8",
               "--out_dir", "run"], tmp_path)
    assert "ranks" not in out.splitlines()[0]
    torch.testing.assert_close(losses(tmp_path / "run"), single)


def test_accelerate_one_and_two_processes_equal_our_trainer(tmp_path, single):
    run([sys.executable, ROOT / "scripts" / "accelerate_train.py", *COMMON, "--batch_size", "8",
         "--out_dir", "one"], tmp_path)
    torch.testing.assert_close(losses(tmp_path / "one"), single)
    out = run([BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--main_process_port", str(free_port()),
               "--mixed_precision", "no", "--dynamo_backend", "no", ROOT / "scripts" / "accelerate_train.py",
               *COMMON, "--batch_size", "4", "--out_dir", "two"], tmp_path)
    assert "Accelerate: 2 process(es)" in out
    torch.testing.assert_close(losses(tmp_path / "two"), single)


def test_lab2_script_equals_the_ddp_trainer_and_proves_the_split(tmp_path):
    """scripts/ddp_simulation_train.py (init_process_group, DistributedSampler, DDP written out) against
    `torchrun -m course_lib.train --strategy ddp` with the same flags: same losses, same final weights."""
    common = [*COMMON, "--batch_size", "4"]
    run([BIN / "torchrun", "--nproc_per_node=2", ROOT / "scripts" / "ddp_simulation_train.py", *common,
         "--out_dir", "script", "--log_dir", "script_logs"], tmp_path)
    run([BIN / "torchrun", "--nproc_per_node=2", "-m", "course_lib.train", "--strategy", "ddp", *common,
         "--out_dir", "trainer", "--log_dir", "trainer_logs"], tmp_path)
    torch.testing.assert_close(losses(tmp_path / "script"), losses(tmp_path / "trainer"))
    script = load_checkpoint(tmp_path / "script" / LATEST, restore_rng=False)["model"]
    trainer = load_checkpoint(tmp_path / "trainer" / LATEST, restore_rng=False)["model"]
    assert script.keys() == trainer.keys()
    for name, tensor in script.items():
        torch.testing.assert_close(tensor, trainer[name], msg=lambda m: f"{name}: {m}")
    logs = [(tmp_path / "script_logs" / f"rank_{r}" / "train.log").read_text() for r in range(2)]
    assert "step 1 rows of the global batch: mine [0, 2, 4, 6]; all ranks [[0, 2, 4, 6], [1, 3, 5, 7]]" in logs[0]
    assert "mine [1, 3, 5, 7]" in logs[1] and "[rank 1/2]" in logs[1]

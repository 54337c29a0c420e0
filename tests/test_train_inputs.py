"""The training CLI and the library never lose work and name what is wrong: the user's data folder is never
written to, a split too short for block_size or a vocabulary too small for the data stops the run before step 1,
a fresh run moves an earlier one aside instead of deleting it, a changed schedule on resume is applied and said,
a failing final evaluation still leaves the final checkpoint, and each bad input of the tables below is named."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from test_train import quick_config  # tests/ is on sys.path (tests/conftest.py)

import course_lib.train as train_module
from course_lib.checkpoint.atomic import EARLIER_RUNS, LATEST, load_checkpoint
from course_lib.core.data import RandomBatches
from course_lib.core.device import select_device
from course_lib.core.model import GPTConfig
from course_lib.core.optim import get_lr
from course_lib.parallel import Parallelized
from course_lib.runtime.demo_workers import allreduce_demo
from course_lib.runtime.env import init_distributed, rank_device
from course_lib.runtime.launch import launch
from course_lib.train import TrainConfig, train


def quick(tmp_path, **overrides) -> TrainConfig:
    """test_train's quick config, shorter: 6 steps of 4 rows, no evaluation until the last step."""
    return quick_config(tmp_path, **{"batch_size": 4, "max_steps": 6, "warmup_steps": 2, "eval_interval": 0,
                                     "eval_batches": 2, **overrides})


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_data_folder_with_the_users_files_is_never_written_to(tmp_path):
    data = tmp_path / "mine"
    data.mkdir()
    np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tofile(data / "train.bin")
    before = digest(data)
    with pytest.raises(FileNotFoundError, match=r"val\.bin is missing.*train\.bin"):
        train(quick(tmp_path, dataset="corpus", data_dir=str(data)))
    assert digest(data) == before, "the user's data folder was written to"


def test_an_empty_split_is_named(tmp_path):
    data = tmp_path / "mine"
    data.mkdir()
    np.zeros(5000, dtype=np.uint8).tofile(data / "train.bin")
    (data / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"val\.bin is empty"):
        train(quick(tmp_path, dataset="corpus", data_dir=str(data)))


def test_a_split_shorter_than_block_size_stops_the_run_before_step_1(tmp_path):
    data = tmp_path / "mine"
    data.mkdir()
    np.ones(5000, dtype=np.uint8).tofile(data / "train.bin")
    np.ones(1000, dtype=np.uint8).tofile(data / "val.bin")
    config = quick(tmp_path, dataset="corpus", data_dir=str(data), block_size=1500, config_path=None)
    with pytest.raises(ValueError, match=r"block_size=1500 does not fit the val split: .*val\.bin holds 1,000 tokens"):
        train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "no step may run before the splits are checked"


def test_a_vocabulary_smaller_than_the_data_is_named(tmp_path):
    config_path = tmp_path / "model.json"
    config_path.write_text('{"vocab_size": 200, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 32}')
    with pytest.raises(ValueError, match=r"vocab_size=200 is too small for the synthetic dataset: it holds token id"):
        train(quick(tmp_path, config_path=str(config_path)))


def test_a_fresh_run_moves_the_earlier_one_aside(tmp_path, capsys):
    first = train(quick(tmp_path, max_steps=4))
    earlier = load_checkpoint(first["checkpoint"], restore_rng=False)
    train(quick(tmp_path, max_steps=3))
    note = capsys.readouterr()
    moved = list((tmp_path / "run" / EARLIER_RUNS).iterdir())
    assert len(moved) == 1 and "moved to" in note.out + note.err
    kept = load_checkpoint(moved[0] / LATEST, restore_rng=False)
    assert kept["step"] == 4 and torch.equal(kept["model"]["tok_emb.weight"], earlier["model"]["tok_emb.weight"])
    assert (moved[0] / "metrics.jsonl").exists()
    assert load_checkpoint(tmp_path / "run" / LATEST, restore_rng=False)["step"] == 3


def test_a_changed_lr_on_resume_is_applied_and_said(tmp_path, capsys):
    train(quick(tmp_path, max_steps=4))
    result = train(quick(tmp_path, max_steps=8, lr=1e-3, resume=True))
    out = capsys.readouterr()
    assert "lr 0.01 -> 0.001" in out.out + out.err
    first_resumed = result["history"][0]
    assert first_resumed["step"] == 5
    want = get_lr(4, max_lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=8)  # min_lr None: lr / 10
    assert first_resumed["lr"] == pytest.approx(want, rel=1e-6)


def test_a_resume_with_another_global_batch_names_the_ranks_and_the_batch(tmp_path):
    train(quick(tmp_path, max_steps=2))
    with pytest.raises(ValueError, match=r"global batch of 4 rows.*--batch_size 8 x 1 replica\(s\) = 8"):
        train(quick(tmp_path, max_steps=4, batch_size=8, resume=True))


def test_a_failing_final_evaluation_still_leaves_the_final_checkpoint(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(Parallelized, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(quick(tmp_path, max_steps=3))
    assert load_checkpoint(tmp_path / "run" / LATEST, restore_rng=False)["step"] == 3


def test_a_bad_master_port_is_named_by_the_fake_multi_node_launcher():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc", "WORLD_SIZE": "2",
           "RANK": "0", "LOCAL_RANK": "0"}
    # the training CLI: tests/test_train_cluster.py (one line, exit code 2, as for a bad flag)
    launcher = subprocess.run([sys.executable, "scripts/fake_multi_node_launcher.py", "--nnodes", "1", "x.py"],
                              env=env, capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parents[1])
    assert launcher.returncode != 0 and "MASTER_PORT='abc' is not a valid int" in launcher.stderr


def test_the_cli_prints_an_input_error_as_one_clear_line(tmp_path):
    data = tmp_path / "mine"
    data.mkdir()
    np.ones(5000, dtype=np.uint8).tofile(data / "train.bin")
    command = [sys.executable, "-m", "course_lib.train", "--data_dir", str(data), "--max_steps", "1",
               "--out_dir", str(tmp_path / "run"), "--no-progress", "--no-tensorboard"]
    cli = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stderr
    assert "val.bin is missing" in cli.stderr and "Traceback" not in cli.stderr
    with pytest.raises(FileNotFoundError, match="val.bin is missing"):  # --debug: the exception itself, traceback and all
        train_module.main(command[3:] + ["--debug"])


@pytest.mark.distributed
def test_ranks_started_by_torchrun_die_with_their_agent(tmp_path):

    metrics = tmp_path / "run" / "metrics.jsonl"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m",
                              "course_lib.train", "--strategy", "ddp", "--dataset", "synthetic", "--max_steps",
                              "100000", "--eval_interval", "0", "--batch_size", "2", "--block_size", "16",
                              "--model_size", "tiny", "--out_dir", str(tmp_path / "run"), "--no-progress",
                              "--no-tensorboard", "--threads", "1", "--log_dir", str(tmp_path / "logs")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics.exists(), "training never started"
        ranks = [p for p in psutil.Process(agent.pid).children(recursive=True)
                 if "course_lib.train" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks still running 10 s after their torchrun agent was killed: {alive}"
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()


def test_evaluate_names_a_bad_split_and_an_empty_file_in_one_line(tmp_path):
    train(quick(tmp_path, max_steps=2))
    data = tmp_path / "mine"
    data.mkdir()
    np.ones(100, dtype=np.uint8).tofile(data / "train.bin")
    (data / "val.bin").write_bytes(b"")
    script = Path(__file__).resolve().parents[1] / "scripts" / "evaluate.py"
    bad_split = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--split", "test"],
                               capture_output=True, text=True, timeout=120)
    assert bad_split.returncode == 2 and "--split: invalid choice: 'test'" in bad_split.stderr
    empty = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--data_dir", str(data)],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "val.bin is empty" in empty.stderr and "Traceback" not in empty.stderr


BAD_CLI_INPUTS = {
    # name: (arguments, what the message must name)
    "batch_size 0": (["--batch_size", "0"], "batch_size"),
    "negative lr": (["--lr", "-1"], "lr must be positive"),
    "unknown preset": (["--model_size", "huge"], "model_size"),
    "unknown precision": (["--precision", "fp8"], "precision"),
    "unknown device": (["--device", "tpu"], "device"),
    "unknown strategy": (["--strategy", "pipeline"], "strategy"),
    "unknown dataset": (["--dataset", "wiki"], "dataset"),
    "max_steps 0": (["--max_steps", "0"], "max_steps"),
    "grad_accum_steps 0": (["--grad_accum_steps", "0"], "grad_accum_steps"),
    "block_size 0": (["--block_size", "0"], "block_size"),
    "warmup longer than the run": (["--warmup_steps", "50", "--max_steps", "10"], "warmup_steps"),
    "min_lr above lr": (["--min_lr", "1", "--lr", "0.1"], "min_lr"),
    "threads 0": (["--threads", "0"], "threads"),
    "eval_batches 0": (["--eval_batches", "0"], "eval_batches"),
    "keep_last 0": (["--keep_last", "0"], "keep_last"),
    "negative grad_clip": (["--grad_clip", "-1"], "grad_clip"),
    "missing model config": (["--config_path", "{tmp}/missing.json"], "missing.json"),
    "model config not JSON": (["--config_path", "{tmp}/broken.json"], "broken.json"),
    "unknown model config field": (["--config_path", "{tmp}/unknown.json"], "n_layers"),
    "resume without a checkpoint": (["--resume", "--out_dir", "{tmp}/empty"], "empty"),
}


@pytest.mark.parametrize("name", BAD_CLI_INPUTS)
def test_each_bad_cli_input_exits_2_naming_what_is_wrong(name, tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "unknown.json").write_text('{"n_layers": 2}')
    arguments, named = BAD_CLI_INPUTS[name]
    argv = [a.format(tmp=tmp_path) for a in arguments]
    for flag, value in (("--dataset", "synthetic"), ("--max_steps", "2"), ("--out_dir", str(tmp_path / "run"))):
        if flag not in argv:
            argv += [flag, value]
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(argv + ["--no-progress", "--no-tensorboard"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def _gpt(**fields):
    return GPTConfig(**fields)


def _launch(*args, **kwargs):
    return launch(allreduce_demo, *args, **kwargs)


def _init(env):
    os.environ.update(env)
    return init_distributed(backend="gloo", device="cpu")


def _rank_device(device):
    return rank_device(0, device)


def _select_device(device):
    return select_device(device)


def _windows(tokens, block_size):
    return RandomBatches(torch.zeros(tokens, dtype=torch.long), 2, block_size)


BAD_LIBRARY_INPUTS = {
    # name: (call, exception, what the message must name)
    "n_embd not divisible by n_head": (lambda: _gpt(n_embd=100, n_head=3), ValueError, "GPTConfig.n_embd (100)"),
    "odd head dimension": (lambda: _gpt(n_embd=12, n_head=4), ValueError, "must be even"),
    "n_layer 0": (lambda: _gpt(n_layer=0), ValueError, "GPTConfig.n_layer"),
    "dropout 1": (lambda: _gpt(dropout=1.0), ValueError, "GPTConfig.dropout"),
    "unknown attention": (lambda: _gpt(attn_impl="flash"), ValueError, "GPTConfig.attn_impl"),
    "negative norm_eps": (lambda: _gpt(norm_eps=-1.0), ValueError, "norm_eps"),
    "world_size 0": (lambda: _launch(0), ValueError, "world_size"),
    "timeout 0": (lambda: _launch(2, timeout_s=0), ValueError, "timeout_s"),
    "RANK outside the world": (lambda: _init({"WORLD_SIZE": "2", "RANK": "5"}), RuntimeError, "RANK=5"),
    "unknown rank device": (lambda: _rank_device("tpu"), ValueError, "'tpu'"),
    "unknown device": (lambda: _select_device("tpu"), ValueError, "'tpu'"),
    "split shorter than a window": (lambda: _windows(10, 64), ValueError, "64"),
}


@pytest.mark.parametrize("name", BAD_LIBRARY_INPUTS)
def test_each_bad_library_input_raises_naming_what_is_wrong(name, monkeypatch):
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    call, exception, named = BAD_LIBRARY_INPUTS[name]
    try:
        with pytest.raises(exception) as info:
            call()
    finally:
        for variable in ("WORLD_SIZE", "RANK"):
            os.environ.pop(variable, None)
    assert named in str(info.value), str(info.value)

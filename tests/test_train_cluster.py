"""The training CLI on a cluster: a scheduler's signal ends the run with a checkpoint (and requeues a Slurm job),
the run resumes bit for bit, and onto another number of ranks with the same global batch; torchrun's environment
errors are one line with exit code 2; the collective timeout is a flag; outputs go under $COURSE_OUTPUT_ROOT."""

import os
import signal
import stat

import pytest
import torch
import torch.distributed as dist

import course_lib.train as train_module
from course_lib.checkpoint.atomic import LATEST, load_checkpoint
from course_lib.core.metrics import read_metrics
from course_lib.runtime.env import DEFAULT_TIMEOUT_S, init_distributed
from course_lib.runtime.launch import launch
from course_lib.train import run_cli

ARGS = ["--dataset", "synthetic", "--model_size", "tiny", "--block_size", "16", "--batch_size", "4", "--max_steps",
        "6", "--warmup_steps", "2", "--eval_interval", "0", "--eval_batches", "2", "--ckpt_interval", "0",
        "--threads", "1", "--no-progress", "--no-tensorboard"]


def losses(out_dir) -> list[tuple[int, str]]:
    return [(r["step"], r["loss"].hex()) for r in read_metrics(out_dir / "metrics.jsonl", kind="train")]


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """A `scontrol` on PATH that records its arguments, and a Slurm job id: what a requeue would call."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return calls


def test_sigusr1_mid_run_checkpoints_requeues_exits_cleanly_and_the_resume_is_bit_exact(tmp_path, monkeypatch,
                                                                                          fake_scontrol, capsys):
    uninterrupted = tmp_path / "full"
    train_module.main(ARGS + ["--out_dir", str(uninterrupted)])
    real_step, steps = train_module.train_step, []

    def step_then_signal(*args, **kwargs):  # Slurm's SIGUSR1 arrives while step 3 runs
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", step_then_signal)
    split = tmp_path / "split"
    result = train_module.main(ARGS + ["--out_dir", str(split)])  # returns: the CLI's process exits 0
    out = capsys.readouterr().out
    assert result["stopped_by"] == "SIGUSR1" and result["final_step"] == 3, result["stopped_by"]
    assert "stopped by SIGUSR1 after step 3 of 6" in out and "Slurm job 4242 requeued" in out, out
    assert fake_scontrol.read_text().split() == ["requeue", "4242"]
    assert load_checkpoint(split / LATEST, restore_rng=False)["step"] == 3
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None), "the CLI must put the handlers back"
    monkeypatch.setattr(train_module, "train_step", real_step)
    resumed = train_module.main(ARGS + ["--out_dir", str(split), "--resume", "auto"])
    assert resumed["start_step"] == 3 and resumed["stopped_by"] is None
    assert losses(split) == losses(uninterrupted), "the resumed run must continue bit for bit"


def test_a_second_signal_stops_at_once(monkeypatch):
    sent = []
    monkeypatch.setattr(train_module.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    previous = signal.getsignal(signal.SIGTERM)
    with train_module.StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) is stop
        stop(signal.SIGTERM, None)
        assert stop.name == "SIGTERM" and sent == []  # the first: stop after this step
        stop(signal.SIGTERM, None)  # the second: the signal's usual effect, now
        assert sent == [(os.getpid(), signal.SIGTERM)] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == previous


@pytest.mark.distributed
def test_a_2_rank_checkpoint_resumes_on_4_ranks_with_the_same_global_batch(tmp_path, capsys):
    one = tmp_path / "one"
    train_module.main(ARGS + ["--batch_size", "8", "--out_dir", str(one)])  # the global batch in one process
    run = tmp_path / "run"
    argv = ARGS + ["--strategy", "ddp", "--out_dir", str(run), "--log_dir", str(tmp_path / "logs")]
    first = launch(run_cli, 2, args=(argv + ["--stop_at_step", "3"],), echo=False, log_dir=tmp_path / "l2")
    assert first[0]["final_step"] == 3
    capsys.readouterr()
    second = launch(run_cli, 4, args=(argv + ["--resume"],), log_dir=tmp_path / "l4")
    assert second[0]["start_step"] == 3 and second[0]["final_step"] == 6
    printed = capsys.readouterr().out
    assert "on 4 replica(s) each now takes 2 rows" in printed, printed
    want = [float.fromhex(h) for _, h in losses(one)]
    got = [float.fromhex(h) for _, h in losses(run)]
    assert [s for s, _ in losses(run)] == list(range(1, 7))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"cannot share equally.*divides 8"):  # 8 rows over 3 replicas
        launch(run_cli, 3, args=(argv + ["--resume", "--max_steps", "8"],), echo=False, log_dir=tmp_path / "l3")


TORCHRUN_ENV_ERRORS = {
    "MASTER_PORT not a number": ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc", "RANK": "0", "WORLD_SIZE": "2"},
                                 "MASTER_PORT must be an integer, got 'abc'"),
    "RANK outside WORLD_SIZE": ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "RANK": "2", "WORLD_SIZE": "2"},
                                "RANK=2 is outside 0..WORLD_SIZE-1"),
    "MASTER_ADDR unset": ({"MASTER_PORT": "29999", "RANK": "0", "WORLD_SIZE": "2"},
                          "environment variable MASTER_ADDR is not set"),
}


@pytest.mark.parametrize("name", TORCHRUN_ENV_ERRORS)
def test_torchrun_environment_errors_are_one_line_with_exit_code_2(name, tmp_path, monkeypatch, capsys):
    variables, named = TORCHRUN_ENV_ERRORS[name]
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(ARGS + ["--strategy", "ddp", "--out_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    first, *rest = err.strip().splitlines()
    assert named in first and "Traceback" not in err and rest == ["(--debug shows where it was raised)"], err
    assert not dist.is_initialized()


def test_the_collective_timeout_is_a_flag_and_defaults_by_backend(tmp_path, monkeypatch):
    seen = []
    real = train_module.init_distributed

    def recording(**kwargs):
        seen.append(kwargs["timeout_s"])
        info = real(**kwargs)
        seen.append(dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        return info

    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(train_module, "init_distributed", recording)
    train_module.main(ARGS + ["--strategy", "ddp", "--max_steps", "1", "--warmup_steps", "0", "--timeout_s", "7",
                              "--out_dir", str(tmp_path / "run")])
    assert seen == [7, 7.0]
    init_distributed(backend="gloo", device="cpu")  # no timeout given: a minute on gloo (10 minutes with NCCL)
    try:
        assert dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds() == DEFAULT_TIMEOUT_S
    finally:
        dist.destroy_process_group()
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(ARGS + ["--timeout_s", "0", "--out_dir", str(tmp_path / "bad")])
    assert exit_info.value.code == 2


def test_relative_output_folders_go_under_course_output_root(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("COURSE_OUTPUT_ROOT", str(scratch))
    monkeypatch.chdir(tmp_path)
    result = train_module.main(ARGS + ["--max_steps", "2", "--warmup_steps", "0", "--out_dir", "runs/mine"])
    assert result["checkpoint"] == scratch / "runs" / "mine" / "ckpt_step000002.pt"
    assert (scratch / "runs" / "mine" / LATEST).is_file() and not (tmp_path / "runs").exists()
    absolute = tmp_path / "elsewhere"
    train_module.main(ARGS + ["--max_steps", "2", "--warmup_steps", "0", "--out_dir", str(absolute)])
    assert (absolute / LATEST).is_file()

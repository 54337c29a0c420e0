"""The single-process trainer: learning, accumulation, clipping, precision, metrics, CLIs, exact resume."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.core.data import synthetic_tokens
from course_lib.core.device import autocast_context, autocast_dtype, select_device
from course_lib.core.metrics import MetricsLogger, read_metrics
from course_lib.core.model import GPT, GPTConfig
from course_lib.train import TrainConfig, main, train
from course_lib.core.steps import accumulate_gradients, clip_gradients, train_step

REPO = Path(__file__).resolve().parents[1]
TINY = GPTConfig.from_preset("tiny", block_size=32)


def quick_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(dataset="synthetic", block_size=32, batch_size=8, max_steps=50, warmup_steps=5, lr=1e-2,
                  eval_interval=25, eval_batches=4, ckpt_interval=0, out_dir=str(tmp_path / "run"),
                  progress=False, tensorboard=False, threads=1)
    values.update(overrides)
    return TrainConfig(**values)


def test_loss_decreases_on_synthetic_data(tmp_path):
    result = train(quick_config(tmp_path))
    losses = [r["loss"] for r in result["history"]]
    assert len(losses) == 50 and [r["step"] for r in result["history"]] == list(range(1, 51))
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # untrained: about uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0
    assert result["final_val_loss"] < losses[0] - 2.0
    assert [e["step"] for e in result["evals"]] == [25, 50]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in result["history"])
    assert (tmp_path / "run" / "latest.pt").exists()  # checkpoint at the end even with ckpt_interval=0


def test_accumulation_matches_one_big_batch():
    torch.manual_seed(0)
    model_a, model_b = GPT(TINY), GPT(TINY)
    model_b.load_state_dict(model_a.state_dict())
    batch = synthetic_tokens(4 * 3 * 32, seed=1).view(12, 32)
    loss_a = accumulate_gradients(model_a, list(batch.split(3)))  # 4 micro-batches of 3
    loss_b = accumulate_gradients(model_b, [batch])  # one batch of 12
    torch.testing.assert_close(loss_a, loss_b)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=f"gradient of {name}")


def test_clipping_caps_the_global_norm():
    model = GPT(TINY)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    norm_before = clip_gradients(model.parameters(), max_norm=0.5)
    assert norm_before > 0.5
    norm_after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm_after <= 0.5
    torch.testing.assert_close(norm_after, torch.tensor(0.5))
    assert clip_gradients(model.parameters(), max_norm=None).item() == pytest.approx(norm_after.item())  # norm only


def test_train_step_updates_and_clears_gradients():
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.tok_emb.weight.detach().clone()
    stats = train_step(model, [synthetic_tokens(64, seed=2).view(2, 32)], optimizer, grad_clip=1.0)
    assert set(stats) == {"loss", "grad_norm", "lr"} and stats["lr"] == 1e-3
    assert not torch.equal(model.tok_emb.weight, before)
    assert all(p.grad is None for p in model.parameters())


def test_device_and_precision_selection():
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert select_device("auto").type == expected
    assert autocast_dtype("cpu", "auto") is None and autocast_dtype("cpu", "bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        autocast_dtype("cpu", "fp16")
    with pytest.raises(ValueError, match="precision"):
        autocast_dtype("cpu", "fp8")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            select_device("cuda")


def test_auto_says_where_it_takes_the_apple_gpu(monkeypatch, capsys):
    import course_lib.core.device as device_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_module, "mps_available", lambda: True)
    monkeypatch.setattr(device_module, "_MPS_SAID", [])
    assert select_device("auto").type == "mps" and select_device("auto").type == "mps"
    printed = capsys.readouterr().out
    assert printed.count("device='auto' chose mps") == 1 and "device='cpu'" in printed, printed


def test_bf16_autocast_on_cpu_trains(tmp_path):
    with autocast_context("cpu", torch.bfloat16):
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    result = train(quick_config(tmp_path, precision="bf16", max_steps=20, eval_interval=0))
    losses = [r["loss"] for r in result["history"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 1.0
    assert next(result["model"].parameters()).dtype == torch.float32  # weights stay fp32 under autocast


def test_train_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="TrainConfig.batch_size must be a positive integer"):
        quick_config(tmp_path, batch_size=0)
    with pytest.raises(ValueError, match=r"TrainConfig.warmup_steps must be <= max_steps \(10\)"):
        quick_config(tmp_path, max_steps=10, warmup_steps=20)
    with pytest.raises(ValueError, match="TrainConfig.model_size"):
        quick_config(tmp_path, model_size="huge")
    with pytest.raises(ValueError, match="TrainConfig.precision"):
        quick_config(tmp_path, precision="half")
    assert quick_config(tmp_path, lr=1e-2).min_lr == pytest.approx(1e-3)


def test_metrics_logger_jsonl_tensorboard_and_resume(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        for step in (1, 2, 3):
            logger.log({"kind": "train", "step": step, "loss": 1.0 / step})
        logger.log({"kind": "eval", "step": 3, "val_loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path, kind="train")] == [1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl", kind="eval") == [{"kind": "eval", "step": 3, "val_loss": 0.5}]
    first_events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(first_events) == 1 and first_events[0].stat().st_size > 0
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=2) as logger:  # steps after 2 are dropped
        logger.log({"kind": "train", "step": 3, "loss": 0.25})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 4, "lo')  # a line cut short by a crash
    assert len(read_metrics(tmp_path)) == 3
    MetricsLogger(tmp_path, tensorboard=False).close()  # a fresh run starts from nothing
    assert read_metrics(tmp_path) == [] and not first_events[0].exists()


def test_cli_help_and_short_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--grad_accum_steps" in help_text and "Micro-batches per optimizer step" in help_text
    assert "--no-tensorboard" in help_text
    with pytest.raises(SystemExit):
        main(["--batch_size", "0"])
    assert "TrainConfig.batch_size" in capsys.readouterr().err
    out_dir = tmp_path / "cli"
    main(["--dataset", "synthetic", "--max_steps", "6", "--batch_size", "4", "--block_size", "32",
          "--eval_interval", "3", "--eval_batches", "2", "--out_dir", str(out_dir), "--no-progress",
          "--threads", "1", "--log_interval", "3"])
    out = capsys.readouterr().out
    assert "step      3 | loss" in out and "final val loss" in out
    assert [r["step"] for r in read_metrics(out_dir, kind="train")] == list(range(1, 7))
    assert list((out_dir / "tb").glob("events.out.tfevents.*"))


def _cli(out_dir, config_path, *extra):
    command = [sys.executable, "-m", "course_lib.train", "--config_path", str(config_path), "--dataset", "synthetic",
               "--block_size", "32", "--batch_size", "4", "--grad_accum_steps", "2", "--max_steps", "12",
               "--warmup_steps", "3", "--eval_interval", "4", "--eval_batches", "2", "--ckpt_interval", "5",
               "--threads", "1", "--no-progress", "--no-tensorboard", "--out_dir", str(out_dir), *extra]
    subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    return [(r["step"], r["loss"].hex(), r["grad_norm"].hex()) for r in read_metrics(out_dir, kind="train")]


@pytest.mark.slow
def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    # Dropout > 0 makes every step draw from torch's global RNG, so the RNG restore is exercised too;
    # accumulation makes the data position advance by two batches per step.
    config_path = tmp_path / "config.json"
    values = json.loads((REPO / "config" / "config.json").read_text())
    config_path.write_text(json.dumps({**values, "dropout": 0.1}))
    uninterrupted = _cli(tmp_path / "full", config_path)
    first_half = _cli(tmp_path / "split", config_path, "--stop_at_step", "7")  # last checkpoint at step 7
    assert [s for s, _, _ in first_half] == list(range(1, 8))
    resumed = _cli(tmp_path / "split", config_path, "--resume")
    assert [s for s, _, _ in uninterrupted] == list(range(1, 13))
    assert resumed == uninterrupted  # float.hex: every bit of every loss and grad norm


@pytest.mark.slow
def test_lab1_script_runs_epochs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("lab1", REPO / "scripts" / "train_tiny_transformer.py")
    lab1 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab1)
    result = lab1.main(["--epochs", "2", "--tokens_per_epoch", "3072", "--batch_size", "8", "--print_every", "2",
                        "--eval_batches", "2", "--config", str(REPO / "config" / "config.json"), "--threads", "1",
                        "--data_dir", str(tmp_path / "data"), "--out_dir", str(tmp_path / "lab1")])
    out = capsys.readouterr().out
    assert "one epoch = 3,072 tokens = 6 steps" in out and "2 epochs = 12 steps" in out
    assert "epoch 2 done at step 12" in out and "final val loss" in out
    assert result["steps"] == 12 and math.isfinite(result["final_val_loss"])
    assert [r["step"] for r in read_metrics(tmp_path / "lab1", kind="eval")] == [6, 12]
    assert (tmp_path / "lab1" / "final.pt").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_with_grad_scaler_on_cuda(tmp_path):
    from course_lib.checkpoint.atomic import load_checkpoint

    result = train(quick_config(tmp_path, device="cuda", precision="fp16", max_steps=30, threads=None))
    losses = [r["loss"] for r in result["history"]]
    assert losses[-1] < losses[0] - 1.0
    ckpt = load_checkpoint(result["checkpoint"], restore_rng=False)
    assert ckpt["scaler"] is not None and ckpt["scaler"]["scale"] > 0

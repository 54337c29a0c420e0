"""The one metrics logger with its experiment helpers: TensorBoard event files hold what was logged, W&B offline
runs are written (when wandb is installed) and read back, and without wandb everything but W&B still works.

    .venv/bin/python -m pytest -q tests/observability/test_experiment_log.py
"""

from __future__ import annotations

import json
import sys

import psutil
import pytest
import torch

from course_lib.core.metrics import WANDB_REQUIREMENT, MetricsLogger
from course_lib.core.model import GPT, GPTConfig
from course_lib.observability.experiment_log import (
    gradient_norms,
    log_gradients,
    log_throughput,
    read_tensorboard_scalars,
    read_wandb_history,
    wandb_available,
)


def backward_once(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset("tiny"))
    idx = torch.randint(0, 256, (2, 16))
    model(idx, targets=idx)[1].backward()
    return model


def test_gradient_norms_combine_into_the_clipping_norm():
    model = backward_once()
    norms = gradient_norms(model)
    assert set(norms) == {"total", "tok_emb", "blocks.0", "blocks.1", "norm_f"}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    assert norms["total"] == pytest.approx(total, rel=1e-5)
    assert sum(v**2 for k, v in norms.items() if k != "total") == pytest.approx(total**2, rel=1e-5)
    per_tensor = gradient_norms(model, depth=None)
    assert per_tensor["blocks.0.attn.q_proj.weight"] == pytest.approx(
        model.blocks[0].attn.q_proj.weight.grad.norm().item(), rel=1e-5)
    with pytest.raises(ValueError, match="after loss.backward"):
        gradient_norms(GPT(GPTConfig.from_preset("tiny")))


def test_tensorboard_and_jsonl_hold_the_logged_values(tmp_path):
    model = backward_once()
    with MetricsLogger(tmp_path, config={"lr": 1e-3}) as logger:
        assert logger.wandb_dir is None
        for step in range(1, 4):
            logger.log_scalars(step, loss=3.0 / step, lr=1e-3)
        norms = log_gradients(logger, model, step=3)
        throughput = log_throughput(logger, 3, tokens=2048, seconds=0.5, flops_per_token=1000)
    assert throughput == {"tokens_per_s": 4096.0, "step_time_s": 0.5, "gflops": pytest.approx(4.096e-3)}
    scalars = read_tensorboard_scalars(logger.tensorboard_dir)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([3.0, 1.5, 1.0])
    assert scalars["grad_norm/total"] == [(3, pytest.approx(norms["total"], rel=1e-6))]
    assert scalars["throughput/tokens_per_s"] == [(3, 4096.0)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"kind": "train", "step": 1, "loss": 3.0, "lr": 1e-3}
    assert {line["kind"] for line in lines} == {"train", "grad_norm", "throughput"}
    with pytest.raises(FileNotFoundError, match="no TensorBoard event file"):
        read_tensorboard_scalars(tmp_path / "elsewhere")


@pytest.mark.skipif(not wandb_available(), reason=f"wandb is not installed ({WANDB_REQUIREMENT})")
def test_wandb_offline_run_is_written_under_out_dir(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with MetricsLogger(tmp_path / "run", config={"lr": 1e-3}, run_name="test", wandb=True) as logger:
        for step in range(1, 4):
            logger.log_scalars(step, loss=3.0 / step)
        run_dir = logger.wandb_dir
    assert run_dir.parent == tmp_path / "run" / "wandb" and run_dir.name.startswith("offline-run-")
    assert list(run_dir.glob("run-*.wandb"))
    rows = read_wandb_history(run_dir)
    assert [(row["_step"], row["train/loss"]) for row in rows] == [(1, 3.0), (2, 1.5), (3, 1.0)]
    assert list(cwd.iterdir()) == [], "W&B must write under out_dir only"
    service = [child for child in psutil.Process().children(recursive=True) if "wandb" in child.name()]
    _, alive = psutil.wait_procs(service, timeout=15)  # teardown asks it to exit; give a busy machine time
    assert alive == [], f"closing the logger must stop wandb's service process, found {alive}"


def test_without_wandb_tensorboard_still_works(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    assert not wandb_available()
    with MetricsLogger(tmp_path, wandb="auto") as logger:
        logger.log_scalars(1, loss=2.0)
    assert "W&B logging off: wandb is not installed" in capsys.readouterr().out
    assert read_tensorboard_scalars(tmp_path / "tb")["train/loss"] == [(1, 2.0)]
    with pytest.raises(ImportError, match=f"pip install {WANDB_REQUIREMENT}"):
        MetricsLogger(tmp_path / "required", wandb=True)
    with pytest.raises(ValueError, match="wandb must be"):
        MetricsLogger(tmp_path / "bad", wandb="offline")

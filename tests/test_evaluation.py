"""scripts/evaluate.py reads every checkpoint the course writes and explains the ones it cannot."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from course_lib.checkpoint.workers import save_ranked
from course_lib.core.model import GPT, GPTConfig
from course_lib.evaluation import held_out_loss, load_model
from course_lib.runtime.launch import launch
from course_lib.train import TrainConfig, train

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "evaluate.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = train(TrainConfig(model_size="tiny", max_steps=4, dataset="synthetic", out_dir=str(out / "run"),
                               progress=False, tensorboard=False, eval_batches=2))
    return out / "run", result["model"]


def same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, msg=name)


def test_file_directory_bare_state_dict_and_dcp(trained, tmp_path):
    run_dir, model = trained
    for path in (run_dir, run_dir / "latest.pt"):
        loaded, what = load_model(path)
        same_weights(loaded, model)
    ddp_style = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save(ddp_style, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="bare state_dict .* pass --model_size"):
        load_model(tmp_path / "bare.pt")
    same_weights(load_model(tmp_path / "bare.pt", GPTConfig.from_preset("tiny"))[0], model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    same_weights(load_model(tmp_path / "dcp", GPTConfig.from_preset("tiny"))[0], model)


@pytest.mark.distributed
def test_ranked_checkpoint(tmp_path):
    saved = launch(save_ranked, 2, args=(str(tmp_path / "ranked"),), log_dir=tmp_path / "logs", echo=False)[0]
    loaded, what = load_model(tmp_path / "ranked")
    assert "ranked checkpoint of 2 ranks" in what
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, saved[name])


def test_perplexity_is_exp_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    result = held_out_loss(model, torch.randint(0, 256, (2000,)), batch_size=4, max_batches=3)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert 150 < result["perplexity"] < 400  # an untrained byte model is close to uniform over 256


def test_cli(trained, tmp_path):
    run_dir, _ = trained
    done = subprocess.run([sys.executable, SCRIPT, run_dir, "--json", "--max_batches", "2", "--data_dir",
                           tmp_path / "data"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    done = subprocess.run([sys.executable, SCRIPT, tmp_path / "notes.pt"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot be read by torch.load" in done.stderr and "expected a course" in done.stderr

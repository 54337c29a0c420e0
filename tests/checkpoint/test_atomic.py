"""Checkpoints: full round trip, clear errors, latest.pt / keep_last, and atomicity under SIGKILL."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn

from course_lib.checkpoint.atomic import (
    LATEST,
    clear_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial_files,
    resolve_resume,
    save_checkpoint,
    save_training_checkpoint,
    unwrap_model,
)
from course_lib.core.data import RandomBatches, synthetic_tokens
from course_lib.core.model import GPT, GPTConfig
from course_lib.core.optim import configure_optimizer, make_scheduler

TINY = GPTConfig.from_preset("tiny", block_size=16)
SCHEDULE = dict(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=20)


def _training_state(seed):
    torch.manual_seed(seed)
    model = GPT(TINY)
    optimizer = configure_optimizer(model, lr=SCHEDULE["max_lr"])
    scheduler = make_scheduler(optimizer, **SCHEDULE)
    batches = RandomBatches(synthetic_tokens(4096), batch_size=2, block_size=16, seed=seed)
    return model, optimizer, scheduler, batches


def _train(model, optimizer, scheduler, batches, steps):
    for _ in range(steps):
        idx = next(batches)
        model(idx, targets=idx)[1].backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _assert_states_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_states_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_states_equal(x, y)
    else:
        assert a == b


def test_round_trip_restores_everything(tmp_path):
    model, optimizer, scheduler, batches = _training_state(seed=0)
    _train(model, optimizer, scheduler, batches, steps=3)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer, scheduler=scheduler, step=3,
                           data_state=batches.state_dict(), extra={"note": "hello"})
    # What each generator would produce next; the load must bring these back.
    expected_draws = (random.random(), np.random.rand(), torch.rand(4))
    expected_next_batch = next(batches)

    model2, optimizer2, scheduler2, batches2 = _training_state(seed=99)
    assert not torch.equal(model2.tok_emb.weight, model.tok_emb.weight)
    ckpt = load_checkpoint(path, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    assert torch.equal(torch.rand(4), expected_draws[2])
    batches2.load_state_dict(ckpt["data_state"])
    assert torch.equal(next(batches2), expected_next_batch)
    _assert_states_equal(model2.state_dict(), model.state_dict())
    _assert_states_equal(optimizer2.state_dict(), optimizer.state_dict())
    assert scheduler2.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 3
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert ckpt["step"] == 3 and ckpt["extra"] == {"note": "hello"}
    assert ckpt["model_config"] == TINY.to_dict()
    torch.load(path, weights_only=True)  # only tensors and plain values: safe loading works


def test_wrappers_are_unwrapped(tmp_path):
    class Wrapper(nn.Module):  # stands in for DistributedDataParallel (.module)
        def __init__(self, module):
            super().__init__()
            self.module = module

    class Compiled(nn.Module):  # stands in for torch.compile's OptimizedModule (._orig_mod)
        def __init__(self, module):
            super().__init__()
            self._orig_mod = module

    model = GPT(TINY)
    wrapped = Compiled(Wrapper(model))
    assert unwrap_model(wrapped) is model
    path = save_checkpoint(tmp_path / "w.pt", model=wrapped, step=0)
    keys = load_checkpoint(path, restore_rng=False)["model"].keys()
    assert keys == model.state_dict().keys()
    load_checkpoint(path, model=Wrapper(GPT(TINY)), restore_rng=False)  # loads into a wrapped model too


def test_missing_file_error_names_path_and_lists_checkpoints(tmp_path):
    save_checkpoint(tmp_path / "ckpt_step000001.pt", model=GPT(TINY), step=1)
    with pytest.raises(FileNotFoundError, match=r"ckpt_step000002\.pt.*ckpt_step000001\.pt"):
        load_checkpoint(tmp_path / "ckpt_step000002.pt")


def test_not_a_course_checkpoint(tmp_path):
    bare = tmp_path / "bare.pt"
    torch.save(GPT(TINY).state_dict(), bare)
    with pytest.raises(ValueError, match=r"not a course_lib checkpoint: it holds a bare state_dict"):
        load_checkpoint(bare)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="not a readable course_lib checkpoint"):
        load_checkpoint(junk)


def test_mismatched_model_lists_keys_and_config_difference(tmp_path):
    path = save_checkpoint(tmp_path / "deep.pt", model=GPT(replace(TINY, n_layer=3)), step=0)
    with pytest.raises(ValueError, match=r"unexpected keys.*blocks\.2\.attn\.q_proj\.weight") as err:
        load_checkpoint(path, model=GPT(TINY))
    assert "'n_layer': (3, 2)" in str(err.value)
    wide = GPT(replace(TINY, n_embd=32))
    expected = r"shape mismatches.*tok_emb\.weight: checkpoint \(256, 64\) vs model \(256, 32\)"
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(path, model=wide)


def test_latest_and_keep_last(tmp_path):
    model = GPT(TINY)
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save_training_checkpoint(tmp_path, step=step, model=model, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_step000002.pt", "ckpt_step000003.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / LATEST
    assert load_checkpoint(tmp_path / LATEST, restore_rng=False)["step"] == 3
    (tmp_path / LATEST).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt_step000003.pt"  # fallback: highest step
    assert resolve_resume(False, tmp_path) is None
    assert resolve_resume("auto", tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        resolve_resume(True, tmp_path / "empty")
    save_training_checkpoint(tmp_path, step=4, model=model)
    assert len(clear_checkpoints(tmp_path)) == 4  # steps 2, 3, 4 and latest.pt
    assert latest_checkpoint(tmp_path) is None


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from course_lib.checkpoint import atomic as checkpoint
    from course_lib.core.model import GPT, GPTConfig

    out = Path(sys.argv[1])
    model = GPT(GPTConfig.from_preset("tiny"))
    checkpoint.save_training_checkpoint(out, step=1, model=model)
    real_save = torch.save

    def stalling_save(obj, f, **kwargs):
        class Stall:  # passes bytes through, then freezes halfway so the parent can kill us
            written = 0
            def write(self, data):
                n = f.write(data)
                Stall.written += len(data)
                if Stall.written > 100_000:
                    f.flush()
                    (out / "HALFWAY").touch()
                    time.sleep(600)
                return n
            def flush(self):
                f.flush()
        real_save(obj, Stall(), **kwargs)

    checkpoint.torch.save = stalling_save
    checkpoint.save_training_checkpoint(out, step=2, model=model)
""")


def test_sigkill_mid_save_leaves_latest_loadable(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (tmp_path / "HALFWAY").exists():
        assert child.poll() is None, f"child exited early: {child.stderr.read().decode()}"
        assert time.monotonic() < deadline, "child never reached the middle of the save"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL

    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt_step000002.pt.")]
    assert len(partial) == 1 and partial[0].stat().st_size > 100_000, "the kill must land mid-write"
    assert not (tmp_path / "ckpt_step000002.pt").exists(), "a partial file sits under the final name"
    assert load_checkpoint(tmp_path / LATEST, restore_rng=False)["step"] == 1
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(partial[0], restore_rng=False)
    assert remove_partial_files(tmp_path) == partial and not partial[0].exists()

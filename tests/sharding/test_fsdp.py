"""FSDP2 on CPU ranks (course_lib.sharding.fsdp): strategies, parity with one process, bytes per rank against the
padding rule, torch's ZeroRedundancyOptimizer against DDP, and `python -m course_lib.train --strategy fsdp`
under torchrun.

    .venv/bin/python -m pytest -q tests/sharding/test_fsdp.py

The rank checks share two launches (2 and 4 ranks, one thread each) and one torchrun job.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from course_lib.core.model import GPT, GPTConfig
from course_lib.evaluation import load_model
from course_lib.runtime.launch import launch, run_each
from course_lib.runtime.spawn import single_process_group
from course_lib.sharding import fsdp_workers as fw
from course_lib.sharding.fsdp import (
    SHARDING_STRATEGIES,
    deepspeed_equivalent,
    fsdp_mesh_shape,
    mixed_precision_policy,
    apply_fsdp,
    shard_rows,
)
from course_lib.train import TrainConfig

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PARITY = dict(steps=3)
TWO_RANK_CALLS = [
    (fw.train_fsdp, dict(strategy="FULL_SHARD", **PARITY)),
    (fw.train_fsdp, dict(strategy="SHARD_GRAD_OP", **PARITY)),
    (fw.fsdp_memory, dict(strategy="FULL_SHARD", config=fw.PADDED)),
    (fw.fsdp_memory, dict(strategy="SHARD_GRAD_OP", config=fw.PADDED)),
    (fw.zero_redundancy_vs_ddp, dict(steps=3)),
]
FOUR_RANK_CALLS = [
    (fw.train_fsdp, dict(strategy="HYBRID_SHARD", ranks_per_node=2, **PARITY)),
    (fw.train_fsdp, dict(strategy="NO_SHARD", **PARITY)),
    (fw.fsdp_memory, dict(strategy="FULL_SHARD", config=fw.PADDED)),
    (fw.fsdp_memory, dict(strategy="HYBRID_SHARD", config=fw.PADDED, ranks_per_node=2)),
    (fw.fsdp_memory, dict(strategy="NO_SHARD", config=fw.PADDED)),
]


def run_checks(calls, world_size, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"logs{world_size}")
    ranks = launch(run_each, world_size, args=(calls,), log_dir=logs, threads_per_rank=1, timeout_s=120)
    return {(fn.__name__, kwargs.get("strategy")): [rank[i] for rank in ranks] for i, (fn, kwargs) in enumerate(calls)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_checks(TWO_RANK_CALLS, 2, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_checks(FOUR_RANK_CALLS, 4, tmp_path_factory)


# ------------------------------------------------------------------ no ranks needed
def test_strategy_table_maps_fsdp1_names_to_zero_stages_and_fsdp2_settings():
    assert {name: s.zero_stage for name, s in SHARDING_STRATEGIES.items()} == \
        {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3}
    assert SHARDING_STRATEGIES["FULL_SHARD"].reshard_after_forward and not SHARDING_STRATEGIES["SHARD_GRAD_OP"].reshard_after_forward
    assert [fsdp_mesh_shape(name, 8, ranks_per_node=4) for name in SHARDING_STRATEGIES] == [(8,), (8,), (8, 1), (2, 4)]


def test_bad_names_get_clear_errors():
    with pytest.raises(ValueError, match="unknown FSDP sharding strategy 'ZERO3'.*FULL_SHARD"):
        apply_fsdp(GPT(GPTConfig.from_preset("tiny")), strategy="ZERO3")
    with pytest.raises(ValueError, match="unknown precision 'int8'.*bf16"):
        mixed_precision_policy("int8")
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must divide world_size \(8\)"):
        fsdp_mesh_shape("HYBRID_SHARD", 8, ranks_per_node=3)
    with pytest.raises(ValueError, match="TrainConfig.sharding must be one of"):
        TrainConfig(strategy="fsdp", sharding="full")


def test_mixed_precision_policies_compute_low_and_reduce_in_fp32():
    assert [(mixed_precision_policy(p).param_dtype, mixed_precision_policy(p).reduce_dtype)
            for p in ("fp32", "bf16", "fp16")] == \
        [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


def test_deepspeed_configs_map_to_fsdp_strategies():
    found = {path.name: deepspeed_equivalent(json.loads(path.read_text()))
             for path in sorted((ROOT / "config").glob("deepspeed_zero*.json"))}
    assert {name: (d["zero_stage"], d["strategy"]) for name, d in found.items()} == {
        "deepspeed_zero1.json": (1, None), "deepspeed_zero2.json": (2, "SHARD_GRAD_OP"),
        "deepspeed_zero3.json": (3, "FULL_SHARD"), "deepspeed_zero3_offload.json": (3, "FULL_SHARD"),
        "deepspeed_zero3_offload_nvme.json": (3, "FULL_SHARD")}
    assert "ZeroRedundancyOptimizer" in found["deepspeed_zero1.json"]["torch"]
    assert "offload=True" in found["deepspeed_zero3_offload.json"]["torch"]
    assert "no NVMe tier" in found["deepspeed_zero3_offload_nvme.json"]["torch"]
    assert {d["precision"] for d in found.values()} == {"bf16"}
    with pytest.raises(ValueError, match="zero_optimization.stage must be one of"):
        deepspeed_equivalent({"zero_optimization": {"stage": 4}})


def test_cpu_offload_and_bf16_policy_train_on_a_one_rank_mesh():
    with single_process_group():
        torch.manual_seed(0)
        model = apply_fsdp(GPT(GPTConfig.from_preset("tiny")), mesh=init_device_mesh("cpu", (1,)), offload=True,
                            mp_policy=mixed_precision_policy("bf16"))
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            logits, loss = model(idx, targets=idx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert logits.dtype == torch.bfloat16 and losses[-1] < losses[0]


def test_shard_rows_is_torch_chunk_padded_to_the_first_chunk():
    for dim0 in range(1, 12):
        for shards in range(1, 6):
            chunks = torch.arange(dim0).chunk(shards)
            for index in range(shards):
                rows, padded = shard_rows(dim0, shards, index)
                assert rows == (len(chunks[index]) if index < len(chunks) else 0)
                assert padded == len(chunks[0]) == math.ceil(dim0 / shards)


# ------------------------------------------------------------------ on ranks
def assert_equals_one_process(ranks, world_size):
    reference = fw.train_one_process(world_size, **PARITY)
    for rank in ranks:
        for name, param in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], param, msg=lambda m: f"{rank['strategy']} {name}: {m}")
    mean_losses = torch.tensor([rank["losses"] for rank in ranks]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"]))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp_two_ranks_equal_one_process(two_ranks, strategy):
    ranks = two_ranks["train_fsdp", strategy]
    assert_equals_one_process(ranks, 2)
    assert ranks[0]["fsdp_modules"] == ["<root>", "blocks.0", "blocks.1"]
    full, local = ranks[1]["shapes"]["blocks.0.mlp.gate_proj.weight"]
    assert full == (128, 64) and local == (64, 64)  # dim 0 split over the 2 ranks


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "NO_SHARD"])
def test_fsdp_four_ranks_equal_one_process(four_ranks, strategy):
    ranks = four_ranks["train_fsdp", strategy]
    assert_equals_one_process(ranks, 4)
    full, local = ranks[3]["shapes"]["tok_emb.weight"]
    assert local == {"HYBRID_SHARD": (128, 64), "NO_SHARD": full}[strategy]  # shard groups of 2 ranks / of 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "strategy"), [(2, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (4, "FULL_SHARD"),
                                                      (4, "HYBRID_SHARD"), (4, "NO_SHARD")])
def test_fsdp_bytes_per_rank_equal_the_padded_prediction(two_ranks, four_ranks, world_size, strategy):
    ranks = (two_ranks if world_size == 2 else four_ranks)["fsdp_memory", strategy]
    for rank in ranks:
        assert rank["measured"] == rank["expected"], f"rank {rank['rank']}"
    n_params = ranks[0]["n_params"]
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):  # the last rank's storage holds padding rows
        assert ranks[-1]["measured"]["params"] > 4 * n_params / world_size
        sums = sum(rank["measured"]["optimizer_states"] - rank["measured"]["step_counters"] for rank in ranks)
        assert sums == 8 * n_params  # Adam's m and v are shaped like the unpadded shards
    if strategy == "NO_SHARD":
        assert ranks[0]["measured"]["params"] == 4 * n_params


@pytest.mark.slow
@pytest.mark.distributed
def test_shard_grad_op_keeps_gathered_parameters_from_forward_to_backward(two_ranks):
    full_shard, shard_grad_op = two_ranks["fsdp_memory", "FULL_SHARD"], two_ranks["fsdp_memory", "SHARD_GRAD_OP"]
    for a, b in zip(full_shard, shard_grad_op):
        assert a["between_forward_and_backward"] == a["measured"]["params"]  # resharded: shards only
        assert b["between_forward_and_backward"] >= 4 * b["n_params"]  # the whole model, gathered


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_redundancy_optimizer_equals_ddp_and_splits_the_adam_state(two_ranks):
    ranks = two_ranks["zero_redundancy_vs_ddp", None]
    for rank in ranks:
        for name, param in rank["adamw"]["params"].items():
            torch.testing.assert_close(rank["zero1"]["params"][name], param)
        assert rank["zero1"]["optimizer_state_bytes"] < 0.6 * rank["adamw"]["optimizer_state_bytes"]
    owned = [set(rank["zero1"]["owned"]) for rank in ranks]
    assert not owned[0] & owned[1] and owned[0] | owned[1] == set(ranks[0]["adamw"]["params"])
    assert sum(r["zero1"]["optimizer_state_bytes"] for r in ranks) == ranks[0]["adamw"]["optimizer_state_bytes"]


# ------------------------------------------------------------------ the trainer under torchrun
COMMON = ["--model_size", "tiny", "--max_steps", "3", "--dataset", "synthetic", "--eval_interval", "3",
          "--eval_batches", "3", "--warmup_steps", "1", "--no-progress", "--no-tensorboard", "--threads", "1"]


def run(args, cwd):
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_train_fsdp_under_torchrun_writes_the_checkpoint_one_process_writes(tmp_path):
    run([BIN / "torchrun", "--nproc_per_node=2", "-m", "course_lib.train", "--strategy", "fsdp", *COMMON,
         "--batch_size", "2", "--out_dir", "fsdp"], tmp_path)
    out = run([sys.executable, "-m", "course_lib.train", "--strategy", "fsdp", "--sharding", "SHARD_GRAD_OP",
               *COMMON, "--batch_size", "4", "--out_dir", "fsdp_one"], tmp_path)
    assert "ranks" not in out.splitlines()[0]  # one process: a group of one rank
    run([sys.executable, "-m", "course_lib.train", *COMMON, "--batch_size", "4", "--out_dir", "single"], tmp_path)
    single = torch.load(tmp_path / "single" / "latest.pt", weights_only=True)
    for run_dir in ("fsdp", "fsdp_one"):
        ckpt = torch.load(tmp_path / run_dir / "latest.pt", weights_only=True)
        torch.testing.assert_close(ckpt["model"], single["model"])
        torch.testing.assert_close(ckpt["optimizer"]["state"], single["optimizer"]["state"])
        assert ckpt["optimizer"]["param_groups"] == single["optimizer"]["param_groups"]  # plain format: resumable anywhere
        assert ckpt["extra"]["val_loss"] == pytest.approx(single["extra"]["val_loss"], rel=1e-5)
        model, what = load_model(tmp_path / run_dir)  # what scripts/evaluate.py loads
        assert "step 3" in what and model.num_params() == 98_624
    assert (tmp_path / "logs" / "rank_1" / "train.log").exists()

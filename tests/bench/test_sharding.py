"""`make bench`'s sharding section: DDP, ZeRO-1/2/3 and FSDP bytes per rank (measured = formula) and step times.

    .venv/bin/python -m pytest -q tests/bench/test_sharding.py    # uses the --quick run of every section that
                                                                  # tests/conftest.py makes once (~1.5 min quiet)
"""

import os

import pytest
import torch
from conftest import section_stdout

from course_tools.bench.sharding import SHARDING_RANKS, WORKLOAD, sharding_rows
from course_tools.bench.sharding_workers import DATA_PARALLEL_STRATEGIES, PeakProbe, sharding_bench
from course_lib.core.model import GPT, GPTConfig
from course_lib.sharding.model_states import live_bytes


@pytest.fixture
def quick_run(bench_quick):
    """The sharding section of the shared `bench.py --quick --json` run (tests/conftest.py): (its stdout, rows)."""
    stdout, report = bench_quick
    return section_stdout(stdout, "sharding"), report["sections"]["sharding"]["tables"]["sharding"]["rows"]


def _by_strategy(rows, world_size):
    return {r["strategy"]: r for r in rows if r["world_size"] == world_size}


@pytest.mark.slow
@pytest.mark.distributed
def test_every_strategy_at_every_world_size_matches_its_formula(quick_run):
    stdout, rows = quick_run
    assert sorted((r["strategy"], r["world_size"]) for r in rows) == sorted(
        (s, n) for s in DATA_PARALLEL_STRATEGIES for n in SHARDING_RANKS)
    for r in rows:
        assert r["agrees"], (r["strategy"], r["world_size"])
        assert r["total_bytes"] == r["expected_total_bytes"] == r["params_bytes"] + r["grads_bytes"] + r[
            "optimizer_bytes"], (r["strategy"], r["world_size"])
        assert r["preset"] == WORKLOAD["quick"]["preset"] and r["local_batch"] * r["world_size"] == r["global_batch"]
    assert "sharding: model-state MB per rank" in stdout and "NO (" not in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_sharding_saves_memory_in_zero_order(quick_run):
    _, rows = quick_run
    for n in SHARDING_RANKS:
        by = _by_strategy(rows, n)
        total = {name: row["total_bytes"] for name, row in by.items()}
        for fully_sharded in ("ZeRO-3", "FSDP FULL_SHARD", "FSDP SHARD_GRAD_OP"):
            assert total[fully_sharded] < total["ZeRO-2"] < total["ZeRO-1"] < total["DDP"], (n, total)
        for name, row in by.items():
            assert row["vs_ddp"] == pytest.approx(row["total_bytes"] / total["DDP"], rel=1e-12)
        n_params = by["DDP"]["n_params"]
        assert total["DDP"] >= 16 * n_params  # 4 + 4 + 8 bytes per parameter, unsharded
        assert by["ZeRO-3"]["total_bytes"] < 16 * n_params / n + 16 * n  # 16 x ceil(P / N): padding < N elements
        # Transients: what is gathered for a moment must show, and only sharded strategies gather.
        assert by["DDP"]["peak_params_bytes"] == by["DDP"]["params_bytes"]
        assert by["ZeRO-3"]["peak_params_bytes"] >= by["ZeRO-3"]["params_bytes"] + by["ZeRO-3"][
            "zero3_peak_gathered_bytes"] > by["ZeRO-3"]["params_bytes"]
        assert by["FSDP SHARD_GRAD_OP"]["peak_params_bytes"] >= by["FSDP SHARD_GRAD_OP"]["params_bytes"] + 4 * n_params
        assert by["FSDP FULL_SHARD"]["params_bytes"] < by["FSDP FULL_SHARD"]["peak_params_bytes"] < by[
            "FSDP SHARD_GRAD_OP"]["peak_params_bytes"]
        assert by["ZeRO-2"]["grads_bytes"] < by["ZeRO-2"]["peak_grads_bytes"] < by["DDP"]["grads_bytes"]


@pytest.mark.slow
@pytest.mark.distributed
def test_step_times_are_positive_and_compared_to_ddp(quick_run):
    stdout, rows = quick_run
    for n in SHARDING_RANKS:
        by = _by_strategy(rows, n)
        for row in by.values():
            assert row["step_ms"] > 0 and row["steps"] == WORKLOAD["quick"]["steps"]
            assert row["time_vs_ddp"] == pytest.approx(row["step_ms"] / by["DDP"]["step_ms"], rel=1e-12)
            assert row["oversubscribed"] == (n * row["threads_per_rank"] > (os.cpu_count() or 1))
    if (os.cpu_count() or 1) < max(SHARDING_RANKS):
        assert "oversubscribed" in stdout


def _rank(strategies: dict) -> dict:
    return {"threads": 1, "strategies": strategies}


def _result(total: int, expected: int, samples=(0.2, 0.1, 0.3)) -> dict:
    memory = {"params": total // 2, "grads": total // 4, "optimizer_states": total - total // 2 - total // 4}
    memory["total"] = total
    return {"n_params": 10, "memory": memory, "expected": {**memory, "total": expected},
            "step_samples": list(samples), "peak_params": total, "peak_grads": total, "peak_gathered": None}


def test_sharding_rows_take_the_maximum_over_ranks_and_flag_disagreement():
    workload = WORKLOAD["quick"]
    ranks = [_rank({"DDP": _result(800, 800), "ZeRO-1": _result(400, 400)}),
             _rank({"DDP": _result(800, 800), "ZeRO-1": _result(408, 400)})]  # the last rank holds padding
    ddp, zero1 = sharding_rows(ranks, cores=2, workload=workload)
    assert (ddp["strategy"], zero1["strategy"]) == ("DDP", "ZeRO-1") and ddp["world_size"] == 2
    assert ddp["agrees"] and not zero1["agrees"]
    assert zero1["total_bytes"] == 408 and zero1["expected_total_bytes"] == 400
    assert zero1["vs_ddp"] == pytest.approx(408 / 800) and ddp["step_ms"] == pytest.approx(200.0)


def test_worker_rejects_bad_settings_before_starting():
    with pytest.raises(ValueError, match="strategies"):
        sharding_bench(strategies=("ZeRO-4",))
    with pytest.raises(ValueError, match="warmup"):
        sharding_bench(warmup=0)
    with pytest.raises(ValueError, match="block_size"):
        sharding_bench(preset="tiny", seq_len=65)


def test_peak_probe_sees_full_parameters_and_gradients_of_a_plain_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    probe = PeakProbe(model)
    idx = torch.randint(0, 256, (2, 16))
    probe.start()
    model(idx, targets=idx)[1].backward()
    probe.stop()
    assert probe.peak["params"] == live_bytes(model.parameters())
    assert probe.peak["grads"] == live_bytes(p.grad for p in model.parameters())
    assert not probe.handles
    model.zero_grad(set_to_none=True)
    probe.peak = {"params": 0, "grads": 0}
    model(idx, targets=idx)[1].backward()  # stopped: no more samples
    assert probe.peak == {"params": 0, "grads": 0}

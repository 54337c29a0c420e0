"""`make bench`'s parallel section: DP, TP and PP bytes per rank (measured = formula), step times and tokens/s.

    .venv/bin/python -m pytest -q tests/bench/test_parallel.py    # uses the --quick run of every section that
                                                                  # tests/conftest.py makes once (~1.5 min quiet)
"""

import os

import pytest
import torch
from conftest import section_stdout

from course_tools.bench.parallel import PARALLEL_RANKS, WORKLOAD, expected_payload_bytes, parallel_rows, ring_wire_bytes
from course_tools.bench.parallel_workers import PARALLEL_STRATEGIES, check_parallel_workload, parallel_bench
from course_lib.core.model import GPT, GPTConfig
from course_lib.pipeline_parallel.schedules import pipeline_comm_bytes
from course_lib.tensor_parallel.tp_layers import tp_allreduce_bytes_per_layer

QUICK = WORKLOAD["quick"]
QUICK_CONFIG = GPTConfig.from_preset(QUICK["preset"], **QUICK["config_overrides"])


@pytest.fixture
def quick_run(bench_quick):
    """The parallel section of the shared `bench.py --quick --json` run (tests/conftest.py): (its stdout, rows)."""
    stdout, report = bench_quick
    return section_stdout(stdout, "parallel"), report["sections"]["parallel"]["tables"]["parallel"]["rows"]


@pytest.mark.slow
@pytest.mark.distributed
def test_every_strategy_at_every_world_size_sends_what_its_formula_says(quick_run):
    stdout, rows = quick_run
    assert sorted((r["strategy"], r["world_size"]) for r in rows) == sorted(
        (s, n) for s in PARALLEL_STRATEGIES for n in PARALLEL_RANKS)
    g, T, m, h = QUICK["global_batch"], QUICK["seq_len"], QUICK["micro_batches"], QUICK_CONFIG.n_embd
    n_params = GPT(QUICK_CONFIG).num_params()
    for r in rows:
        n, where = r["world_size"], (r["strategy"], r["world_size"])
        assert r["agrees"] and r["payload_bytes"] == r["expected_payload_bytes"], where
        assert r["per_rank_payload_bytes"] == r["per_rank_expected_bytes"] and len(r["per_rank_payload_bytes"]) == n
        assert r["n_layer"] == 4 and r["n_params"] == n_params and r["messages"] > 0, where
        if r["strategy"] == "DP":  # the fp32 gradient, all-reduced once; a ring sends 2(n-1)/n of it
            assert r["per_rank_payload_bytes"] == [4 * n_params] * n
            assert r["wire_bytes"] == pytest.approx(4 * n_params * 2 * (n - 1) / n)
        elif r["strategy"] == "TP":
            assert r["per_rank_payload_bytes"] == [4 * tp_allreduce_bytes_per_layer(g, T, h)] * n
            assert r["messages"] == 4 * 4  # 2 forward + 2 backward all-reduces per layer, 4 layers
            assert r["wire_bytes"] == pytest.approx(r["payload_bytes"] * 2 * (n - 1) / n)
        else:  # the stages together send the library's pipeline volume, plus the tied gradient twice
            volume = pipeline_comm_bytes(n, m, g // m, T, h, vocab_size=QUICK_CONFIG.vocab_size)
            assert sum(r["per_rank_payload_bytes"]) == volume["total"] + 2 * volume["tied_grad"], where
            assert r["wire_bytes"] == r["payload_bytes"]
    assert "parallel: step time and bytes communicated" in stdout and "NO (" not in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_step_times_and_tokens_per_second_are_positive_and_compared_to_dp(quick_run):
    stdout, rows = quick_run
    cores = os.cpu_count() or 1
    for n in PARALLEL_RANKS:
        by = {r["strategy"]: r for r in rows if r["world_size"] == n}
        for r in by.values():
            assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["steps"] == QUICK["steps"]
            assert r["tokens_per_step"] == QUICK["global_batch"] * QUICK["seq_len"]
            assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3), rel=1e-9)
            assert r["speed_vs_dp"] == pytest.approx(r["tokens_per_s"] / by["DP"]["tokens_per_s"], rel=1e-12)
            assert r["wire_vs_dp"] == pytest.approx(r["wire_bytes"] / by["DP"]["wire_bytes"], rel=1e-12)
            assert r["oversubscribed"] == (n * r["threads_per_rank"] > cores)
        assert by["DP"]["sequences_per_rank"] * n == by["TP"]["sequences_per_rank"] == QUICK["global_batch"]
        assert by["PP 1F1B"]["ideal_bubble"] == pytest.approx((n - 1) / (QUICK["micro_batches"] + n - 1))
    if cores < max(PARALLEL_RANKS):
        assert "oversubscribed" in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_every_strategy_trains_the_same_model_on_the_same_batch(quick_run):
    _, rows = quick_run
    dp = next(r for r in rows if r["strategy"] == "DP" and r["world_size"] == PARALLEL_RANKS[0])
    for r in rows:
        # fp32 losses of the same batch, summed in a different order by each layout: fp32's tolerances, not the
        # float64 ones that plain Python floats would get (two ulps apart is the same loss)
        torch.testing.assert_close(r["first_loss"], dp["first_loss"], rtol=1.3e-6, atol=1e-5,
                                   msg=f"{r['strategy']} at {r['world_size']}: {r['first_loss']} vs {dp['first_loss']}")


# ------------------------------------------------------------------------------------- without ranks
def _rank(payloads: dict, samples=(0.2, 0.1, 0.3)) -> dict:
    """One rank's result: {strategy: payload bytes of each of its timed steps}."""
    return {"threads": 1, "n_params": 1000, "strategies": {
        name: {"step_samples": list(samples), "payload_bytes": list(steps), "calls": [1] * len(steps),
               "first_loss": 5.5} for name, steps in payloads.items()}}


def test_parallel_rows_take_the_busiest_rank_and_flag_any_step_off_its_formula():
    dp = expected_payload_bytes("DP", QUICK_CONFIG, 1000, 2, 0, global_batch=8, seq_len=64, micro_batches=4)
    pp = [expected_payload_bytes("PP 1F1B", QUICK_CONFIG, 1000, 2, rank, global_batch=8, seq_len=64,
                                 micro_batches=4) for rank in range(2)]
    assert dp == 4000
    ranks = [_rank({"DP": [dp] * 3, "PP 1F1B": [pp[0]] * 3}, samples=(0.1, 0.2, 0.1)),
             _rank({"DP": [dp, dp + 4, dp], "PP 1F1B": [pp[1] + 8] * 3}, samples=(0.1, 0.2, 0.1))]
    rows = {r["strategy"]: r for r in parallel_rows(ranks, cores=2, workload=QUICK)}
    assert not rows["DP"]["agrees"]  # one step of rank 1 sent 4 bytes too many, though its last step was right
    assert not rows["PP 1F1B"]["agrees"] and rows["PP 1F1B"]["payload_bytes"] == max(pp) + 8
    assert rows["DP"]["wire_bytes"] == pytest.approx(dp)  # 2(n-1)/n = 1 at n = 2
    assert rows["DP"]["step_ms"] == pytest.approx(100.0) and rows["DP"]["speed_vs_dp"] == 1.0
    assert rows["PP 1F1B"]["tokens_per_s"] == pytest.approx(8 * 64 / 0.1)
    good = [_rank({"DP": [dp] * 3}), _rank({"DP": [dp] * 3})]
    assert parallel_rows(good, cores=2, workload=QUICK)[0]["agrees"]


def test_pipeline_stages_send_activations_right_gradients_left_and_the_tied_gradient_at_the_ends():
    g, T, m, h, V = 8, 64, 4, QUICK_CONFIG.n_embd, QUICK_CONFIG.vocab_size
    message, tied = (g // m) * T * h * 4, V * h * 4
    per_stage = [expected_payload_bytes("PP GPipe", QUICK_CONFIG, 0, 4, rank, global_batch=g, seq_len=T,
                                        micro_batches=m) for rank in range(4)]
    assert per_stage == [m * message + tied, 2 * m * message, 2 * m * message, m * message + tied]
    volume = pipeline_comm_bytes(4, m, g // m, T, h, vocab_size=V)
    assert sum(per_stage) == volume["total"] + 2 * volume["tied_grad"]
    tp = expected_payload_bytes("TP", QUICK_CONFIG, 0, 4, 3, global_batch=g, seq_len=T, micro_batches=m)
    assert tp == QUICK_CONFIG.n_layer * 4 * g * T * h * 4  # the same on every rank, whatever the world size
    assert ring_wire_bytes("TP", tp, 4) == pytest.approx(tp * 1.5) and ring_wire_bytes("PP 1F1B", 10, 4) == 10
    with pytest.raises(ValueError, match="unknown strategy"):
        expected_payload_bytes("ZeRO-3", QUICK_CONFIG, 0, 2, 0, global_batch=g, seq_len=T, micro_batches=m)


def test_bad_workloads_are_rejected_before_any_rank_starts():
    tiny = GPTConfig.from_preset("tiny")  # 2 blocks: too few for 4 pipeline stages
    with pytest.raises(ValueError, match="n_layer"):
        check_parallel_workload(tiny, 4, global_batch=8, seq_len=64, micro_batches=4)
    with pytest.raises(ValueError, match="global_batch"):
        check_parallel_workload(QUICK_CONFIG, 4, global_batch=6, seq_len=64, micro_batches=2)
    with pytest.raises(ValueError, match="micro_batches"):
        check_parallel_workload(QUICK_CONFIG, 2, global_batch=8, seq_len=64, micro_batches=3)
    with pytest.raises(ValueError, match="block_size"):
        check_parallel_workload(QUICK_CONFIG, 2, global_batch=8, seq_len=65, micro_batches=4)
    with pytest.raises(ValueError, match="n_head"):
        check_parallel_workload(GPTConfig.from_preset("tiny", n_layer=4, n_head=2), 4, global_batch=8, seq_len=64,
                                micro_batches=4)
    with pytest.raises(ValueError, match="strategies"):
        parallel_bench(strategies=("ZeRO-3",))
    with pytest.raises(ValueError, match="warmup"):
        parallel_bench(warmup=0)

"""course_lib.memory.formulas: ZeRO memory per GPU (the paper's numbers), traffic per step, checkpoint interval."""

import math

import pytest

from course_lib.memory import formulas
from course_lib.memory.formulas import (
    break_even_tokens_per_gpu,
    checkpoint_bytes,
    comm_seconds,
    compute_seconds,
    data_parallel_traffic,
    expected_waste,
    young_interval,
    zero_memory_per_gpu,
    zero_table,
)


def test_zero_paper_figure_1_example():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
    totals = [zero_memory_per_gpu(7.5e9, 64, stage).total / 1e9 for stage in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_zero_formulas_by_hand():
    psi, n = 1000, 10
    assert zero_memory_per_gpu(psi, n, 0) == formulas.ZeroMemory(0, 2 * psi, 2 * psi, 12 * psi)
    assert zero_memory_per_gpu(psi, n, 1) == formulas.ZeroMemory(1, 2 * psi, 2 * psi, 12 * psi / n)
    assert zero_memory_per_gpu(psi, n, 2) == formulas.ZeroMemory(2, 2 * psi, 2 * psi / n, 12 * psi / n)
    assert zero_memory_per_gpu(psi, n, 3) == formulas.ZeroMemory(3, 2 * psi / n, 2 * psi / n, 12 * psi / n)


def test_savings_depend_on_the_data_parallel_size():
    small = {row["stage"]: row["saving"] for row in zero_table(7e9, 8)}
    large = {row["stage"]: row["saving"] for row in zero_table(7e9, 4096)}
    assert small[1] == pytest.approx(16 / (4 + 12 / 8)) and small[2] == pytest.approx(16 / (2 + 14 / 8))
    assert small[3] == pytest.approx(8)
    assert small[1] < large[1] < 4 and small[2] < large[2] < 8  # the paper's 4x and 8x are limits
    assert large[1] == pytest.approx(4, rel=0.01) and large[2] == pytest.approx(8, rel=0.01)


def test_traffic_ddp_and_zero3():
    assert data_parallel_traffic(1e9, 8) == pytest.approx(2 * 7 / 8 * 2e9)
    assert data_parallel_traffic(1e9, 8, strategy="zero3") == pytest.approx(1.5 * data_parallel_traffic(1e9, 8))
    assert data_parallel_traffic(1e9, 1) == 0
    assert comm_seconds(100e9, 50e9) == 2.0


def test_break_even_is_where_compute_equals_communication():
    n_params, gpus, flops, busbw = 7e9, 64, 400e12, 50e9
    tokens = break_even_tokens_per_gpu(gpus, flops, busbw)
    comm = comm_seconds(data_parallel_traffic(n_params, gpus), busbw)
    assert compute_seconds(n_params, tokens, flops) == pytest.approx(comm)
    assert break_even_tokens_per_gpu(gpus, flops, busbw, strategy="zero3") == pytest.approx(1.5 * tokens)


def test_checkpoint_interval():
    assert checkpoint_bytes(7e9) == 14 * 7e9
    delta, mtbf = 20.0, 12 * 3600.0
    best = young_interval(delta, mtbf)
    assert best == pytest.approx(math.sqrt(2 * delta * mtbf))
    waste = [expected_waste(t, delta, mtbf) for t in (best / 2, best, best * 2)]
    assert waste[1] < waste[0] and waste[1] < waste[2]  # Young's interval minimises the first-order waste
    assert expected_waste(best, delta, mtbf, restart_s=600) == pytest.approx(waste[1] + 600 / mtbf)


@pytest.mark.parametrize("call,match", [
    (lambda: zero_memory_per_gpu(7e9, 0, 1), "n_gpus"), (lambda: zero_memory_per_gpu(7e9, 8, 4), "stage"),
    (lambda: zero_memory_per_gpu(-1, 8, 1), "n_params"), (lambda: zero_memory_per_gpu(7e9, 2.5, 1), "n_gpus"),
    (lambda: data_parallel_traffic(7e9, 8, strategy="fsdp"), "strategy"),
    (lambda: young_interval(0, 3600), "checkpoint_s"), (lambda: comm_seconds(1, 0), "busbw"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_prints_the_tables(capsys):
    formulas.main(["zero", "--params", "7.5e9", "--gpus", "64"])
    out = capsys.readouterr().out
    assert "120 GB" in out and "31.4 GB" in out and "1.88 GB" in out and "64.00x" in out
    formulas.main(["comm", "--params", "7e9", "--gpus", "64", "--busbw-gbs", "50", "--tflops", "400"])
    assert "zero3" in capsys.readouterr().out
    formulas.main(["checkpoint", "--params", "7e9", "--write-gbs", "5", "--mtbf-hours", "12"])
    assert "Young's interval" in capsys.readouterr().out

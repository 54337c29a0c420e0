"""course_lib.timing (warm-up, medians, alternation, threads) and a smoke run of scripts/bench.py."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.timing import (
    Timing, machine_info, machine_line, setup_threads, time_alternating, time_fn,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """scripts/bench.py imported as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


class FakeClock:
    """A clock that only moves when a timed function advances it: timings become exact numbers."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted(clock: FakeClock, durations):
    """A function whose i-th call takes durations[i] seconds of fake time."""
    it = iter(durations)

    def fn():
        clock.now += next(it)
    return fn


def test_time_fn_drops_warmup_and_takes_the_median():
    clock = FakeClock()
    # Two slow warm-up calls (100 s) must not show up; the median of 1, 5, 2, 9, 3 is 3.
    fn = scripted(clock, [100.0, 100.0, 1.0, 5.0, 2.0, 9.0, 3.0])
    t = time_fn(fn, warmup=2, repeats=5, clock=clock)
    assert t.samples == (1.0, 5.0, 2.0, 9.0, 3.0)
    assert t.median == 3.0
    assert t.quartiles == (2.0, 5.0)
    assert t.relative_spread == pytest.approx(1.0)


def test_time_fn_calls_sync_around_each_timed_call():
    events = []
    time_fn(lambda: events.append("fn"), warmup=1, repeats=2, sync=lambda: events.append("sync"))
    assert events == ["fn", "sync", "fn", "sync", "sync", "fn", "sync"]


def test_time_alternating_takes_turns_after_warmup():
    clock = FakeClock()
    order = []

    def make(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return fn

    result = time_alternating({"A": make("A", 2.0), "B": make("B", 0.5)}, warmup=1, rounds=3, clock=clock)
    assert order == ["A", "B"] * 4
    assert list(result) == ["A", "B"]
    assert result["A"].samples == (2.0, 2.0, 2.0)
    assert result["A"].median / result["B"].median == 4.0


def test_alternation_shares_machine_noise():
    """A slowdown that hits one round hits both variants, so the per-round ratio stays put."""
    clock = FakeClock()
    load = iter([1, 1, 10, 10, 1, 1])  # round 2 of 3 runs ten times slower, for both variants

    def make(seconds):
        def fn():
            clock.now += seconds * next(load)
        return fn

    result = time_alternating({"A": make(3.0), "B": make(1.0)}, warmup=0, rounds=3, clock=clock)
    assert [a / b for a, b in zip(result["A"].samples, result["B"].samples)] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(warmup=-1), "warmup"), (dict(repeats=0), "repeats"), (dict(repeats=2.5), "repeats"),
    (dict(warmup=True), "warmup"),
])
def test_time_fn_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_fn(lambda: None, **kwargs)


def test_bad_callables_and_mappings():
    with pytest.raises(TypeError, match="fn must be callable"):
        time_fn(42)
    with pytest.raises(ValueError, match="non-empty mapping"):
        time_alternating({})
    with pytest.raises(TypeError, match=r"fns\['B'\] must be callable"):
        time_alternating({"A": lambda: None, "B": None})
    with pytest.raises(ValueError, match="rounds"):
        time_alternating({"A": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="at least one sample"):
        Timing(())


def test_setup_threads_sets_and_validates():
    before = torch.get_num_threads()
    try:
        assert setup_threads(1) == 1 == torch.get_num_threads()
        assert setup_threads() >= 1
        with pytest.raises(ValueError, match="num_threads"):
            setup_threads(0)
    finally:
        torch.set_num_threads(before)


def test_machine_line_names_cores_threads_and_torch():
    info = machine_info()
    assert info["cores"] >= 1 and info["torch_threads"] == torch.get_num_threads()
    line = machine_line(info)
    assert f"{info['cores']} cores" in line and torch.__version__ in line and "torch threads" in line


def test_bench_only_selects_and_rejects_sections(bench, capsys):
    names = [s.name for s in bench.SECTIONS]
    assert [s.name for s in bench.select_sections(f"{names[-1]},{names[0]}")] == [names[0], names[-1]]
    with pytest.raises(SystemExit):
        bench.main(["--only", f"{names[0]},nope"])
    assert "unknown section(s) ['nope']" in capsys.readouterr().err


def test_bench_table_aligns_columns(bench):
    result = bench.SectionResult(title="t", columns=[bench.Column("name", "name"), bench.Column("x", "x", "{:.1f}")],
                                 rows=[{"name": "a", "x": 1.0}, {"name": "bbb", "x": None}])
    assert bench.format_table(result).splitlines() == ["name    x", "----  ---", "a     1.0", "bbb     -"]


def _numbers(row):
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.slow
def test_bench_quick_writes_consistent_json(tmp_path, bench):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["sections"]) == {s.name for s in bench.SECTIONS}
    assert report["machine"]["torch_threads"] >= 1 and "machine:" in proc.stdout
    may_be_zero = {"spread", "step_spread", *bench.PROFILE_SHARES}  # spreads and time shares can be 0
    for name, section in report["sections"].items():
        assert section["rows"], f"section {name} has no rows"
        for row in section["rows"]:
            numbers = _numbers(row)
            assert numbers and all(math.isfinite(v) and v >= 0 for v in numbers.values()), (name, row)
            assert all(v > 0 for k, v in numbers.items() if k not in may_be_zero), (name, row)

    train = report["sections"]["train"]["rows"]
    assert {"tiny", "small"} <= {r["preset"] for r in train}
    for r in train:
        assert r["tokens_per_step"] == r["batch_size"] * r["seq_len"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3), rel=1e-9)
        assert r["gflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e9, rel=1e-9)
        assert r["fraction"] == pytest.approx(r["gflops"] / r["matmul_gflops"], rel=1e-9)

    for r in report["sections"]["profile"]["rows"]:
        assert sum(r[k] for k in bench.PROFILE_SHARES) == pytest.approx(100.0)

    attention = report["sections"]["attention"]["rows"]
    assert {(r["seq_len"], r["pass"]) for r in attention} == {
        (T, p) for T in (128, 512) for p in ("forward", "forward+backward")}
    for r in attention:
        assert r["speedup"] == pytest.approx(r["explicit_ms"] / r["sdpa_ms"], rel=1e-9)
        if r["pass"] == "forward+backward":
            # The explicit path keeps a (T, T) matrix per head for backward; SDPA does not.
            assert r["saved_explicit_mb"] >= r["scores_mb"] > r["saved_sdpa_mb"]

"""scripts/bench.py (`make bench`): the section registry, the tables, and one --quick run of every section.

    .venv/bin/python -m pytest -q tests/bench/test_bench.py     # ~2 min on a quiet 2-core machine: one quick run, shared
"""

import math
import os

import bench  # scripts/ is on sys.path (tests/conftest.py)
import pytest
from conftest import section_stdout

from course_tools.bench.profile import PROFILE_SHARES
from course_tools.bench.report import Column, Section, Table, as_tables, format_section, format_table


def test_bench_list_shows_every_section(capsys):
    bench.main(["--list"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [s.name for s in bench.SECTIONS]
    assert {"matmul", "train", "profile", "attention", "comm", "sharding", "parallel"} <= {
        s.name for s in bench.SECTIONS}
    assert all(isinstance(s, Section) and s.description in line for s, line in zip(bench.SECTIONS, lines))


def test_bench_only_selects_and_rejects_sections(capsys):
    names = [s.name for s in bench.SECTIONS]
    assert [s.name for s in bench.select_sections(f"{names[-1]},{names[0]}")] == [names[0], names[-1]]
    with pytest.raises(SystemExit):
        bench.main(["--only", f"{names[0]},nope"])
    assert "unknown section(s) ['nope']" in capsys.readouterr().err


def test_bench_table_aligns_columns():
    table = Table(title="t", columns=[Column("name", "name"), Column("x", "x", "{:.1f}")],
                  rows=[{"name": "a", "x": 1.0}, {"name": "bbb", "x": None}])
    assert format_table(table).splitlines() == ["name    x", "----  ---", "a     1.0", "bbb     -"]


def test_sections_may_return_several_named_tables():
    one = Table(title="only", columns=[Column("x", "x")], rows=[{"x": 1}])
    assert [t.name for t in as_tables(one, "demo")] == ["demo"]
    pair = [Table(title="first", columns=[Column("x", "x")], rows=[{"x": 1}], name="a"),
            Table(title="second", columns=[Column("y", "y")], rows=[{"y": 2}], name="b", setup="2 ranks x 1 thread")]
    tables = as_tables(pair, "demo")
    text = format_section("demo", tables, {"cpu": "CPU", "cores": 2, "torch_threads": 2, "torch_version": "x"}, 3.0)
    assert text.index("== demo: first") < text.index("== demo: second") < text.index("(demo: 3 s)")
    assert "2 ranks x 1 thread" in text and "2 torch threads (one process)" in text
    with pytest.raises(ValueError, match="same name"):
        as_tables([Table(title="a", columns=[], rows=[]), Table(title="b", columns=[], rows=[])], "demo")
    with pytest.raises(TypeError, match="must return a Table"):
        as_tables({"rows": []}, "demo")


@pytest.fixture
def quick_run(bench_quick):
    """The --quick run of every section (tests/conftest.py runs it once for all bench tests)."""
    return bench_quick


def _rows(report, section, table=None):
    return report["sections"][section]["tables"][table or section]["rows"]


def _numbers(row):
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_quick_writes_consistent_json(quick_run):
    stdout, report = quick_run
    assert set(report["sections"]) == {s.name for s in bench.SECTIONS}
    assert report["machine"]["torch_threads"] >= 1 and "machine:" in stdout
    assert "total:" in stdout and all(f"({s.name}: " in stdout for s in bench.SECTIONS)  # wall time per section
    may_be_zero = {"spread", "step_spread", *PROFILE_SHARES,  # spreads and time shares can be 0
                   # one rank sends nothing; a capacity factor above 1 may drop nothing
                   "forward_bytes", "expected_forward_bytes", "backward_bytes", "expected_backward_bytes",
                   "off_rank_bytes", "dropped"}
    for name, section in report["sections"].items():
        assert section["tables"] and section["wall_s"] > 0, name
        for table_name, table in section["tables"].items():
            assert table["rows"], f"table {name}/{table_name} has no rows"
            for row in table["rows"]:
                numbers = _numbers(row)
                assert numbers and all(math.isfinite(v) and v >= 0 for v in numbers.values()), (name, row)
                assert all(v > 0 for k, v in numbers.items() if k not in may_be_zero), (name, row)

    train = _rows(report, "train")
    assert {"tiny", "small"} <= {r["preset"] for r in train}
    for r in train:
        assert r["tokens_per_step"] == r["batch_size"] * r["seq_len"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3), rel=1e-9)
        assert r["gflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e9, rel=1e-9)
        assert r["fraction"] == pytest.approx(r["gflops"] / r["matmul_gflops"], rel=1e-9)

    versus = _rows(report, "vs")
    assert [r["model"].split(" (")[0] for r in versus] == [
        "course GPT", "course GPT, its three formulas op by op",
        "course GPT, LayerNorm kernels for RMSNorm and no RoPE", "GPT-2 of torch built-ins"]
    for r in versus:
        assert r["ratio"] == pytest.approx(r["gflops"] / versus[-1]["gflops"], rel=1e-9)
    assert [r["mode"] for r in versus] == ["eager"] * 4  # --quick leaves the compiled pair out
    assert f"achieved model GFLOP/s: eager {versus[0]['ratio']:.2f}x" in section_stdout(stdout, "vs")

    for r in _rows(report, "profile"):
        assert sum(r[k] for k in PROFILE_SHARES) == pytest.approx(100.0)

    attention = _rows(report, "attention")
    assert {(r["seq_len"], r["pass"]) for r in attention} == {
        (T, p) for T in (128, 512) for p in ("forward", "forward+backward")}
    for r in attention:
        assert r["speedup"] == pytest.approx(r["explicit_ms"] / r["sdpa_ms"], rel=1e-9)
        if r["pass"] == "forward+backward":
            # The explicit path keeps a (T, T) matrix per head for backward; SDPA does not.
            assert r["saved_explicit_mb"] >= r["scores_mb"] > r["saved_sdpa_mb"]


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_quick_comm_section(quick_run):
    stdout, report = quick_run
    cores = os.cpu_count() or 1
    all_reduce = _rows(report, "comm", "all_reduce")
    assert {(r["impl"], r["world_size"]) for r in all_reduce} == {
        (impl, n) for impl in ("gloo", "ring") for n in (2, 4)}
    assert len({r["size_mib"] for r in all_reduce}) >= 2
    for r in all_reduce:
        n = r["world_size"]
        assert r["algbw_gbs"] == pytest.approx(r["size_mib"] * 2**20 / r["seconds"] / 1e9, rel=1e-9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 * (n - 1) / n, rel=1e-9)
        assert r["oversubscribed"] == (n * r["threads_per_rank"] > cores)
        if r["impl"] == "ring":
            gloo = next(g for g in all_reduce if g["impl"] == "gloo" and g["world_size"] == n
                        and g["size_mib"] == r["size_mib"])
            assert r["ring_over_gloo"] == pytest.approx(r["seconds"] / gloo["seconds"], rel=1e-9)
    if cores < 4:  # 4 ranks cannot each have a core: the output must say so
        assert "oversubscribed" in stdout

    throughput = _rows(report, "comm", "throughput")
    assert [(r["world_size"], r["threads_per_rank"]) for r in throughput] == [(1, cores), (2, max(1, cores // 2))]
    assert len({r["global_batch"] for r in throughput}) == 1  # the same global batch in every row
    for r in throughput:
        assert r["local_batch"] * r["world_size"] == r["global_batch"]
        assert r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["global_batch"] * r["seq_len"] / (r["step_ms"] / 1e3), rel=1e-9)
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / throughput[0]["tokens_per_s"], rel=1e-9)


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_quick_context_and_experts_sections(quick_run):
    """Every rank of every ring sends exactly the formula's bytes, zigzag balances the work and a contiguous split
    does not; every all-to-all moves the E x C x d buffer, four per step."""
    stdout, report = quick_run
    context = _rows(report, "context")
    assert [(r["strategy"], r["world_size"]) for r in context] == [
        ("one process", 1), ("ring, contiguous", 2), ("ring, zigzag", 2), ("ring, contiguous", 4), ("ring, zigzag", 4)]
    for r in context:
        n = r["world_size"]
        assert r["agrees"] and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["seq_len"] / (r["step_ms"] / 1e3), rel=1e-9)
        assert r["forward_bytes"] == r["expected_forward_bytes"] and r["backward_bytes"] == r["expected_backward_bytes"]
        block = r["expected_forward_bytes"] / max(1, 2 * (n - 1))
        assert (n == 1) or r["expected_backward_bytes"] == (4 * (n - 1) + 2) * block
        if "zigzag" in r["strategy"]:
            assert r["balance"] == 1.0
        elif n > 1:
            assert r["balance"] > 2 * n - 1.5  # rank N-1 computes about 2N - 1 times rank 0's pairs
    experts = _rows(report, "experts")
    assert [r["world_size"] for r in experts] == [1, 2, 4]
    for r in experts:
        assert r["agrees"] and r["all_to_alls"] == 4 and r["all_to_all_elements"] == r["expected_elements"]
        assert r["off_rank_bytes"] == pytest.approx(4 * r["expected_elements"] * 4 * (r["world_size"] - 1) / r["world_size"])
        assert 0 <= r["dropped"] < 1
    assert "zigzag" in section_stdout(stdout, "context") and "E C d" in section_stdout(stdout, "experts")

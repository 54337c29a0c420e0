"""course_lib.viz.diagrams: the figures draw what their formulas say, deterministically, and the book's copies are current."""

import matplotlib

matplotlib.use("Agg")  # no display in tests

import make_figures  # scripts/ is on sys.path (tests/conftest.py)
import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from course_lib.memory.formulas import zero_memory_per_gpu
from course_lib.viz import diagrams


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("n_ranks", [4, 6, 8, 14, 16])
def test_double_binary_tree_is_two_trees_whose_inner_nodes_are_disjoint(n_ranks):
    for parents in diagrams.double_binary_tree(n_ranks):
        assert sorted(parents) == list(range(n_ranks))
        roots = [r for r, p in parents.items() if p is None]
        assert len(roots) == 1
        for rank in parents:  # every rank reaches the root: a tree, no cycles
            seen, node = set(), rank
            while parents[node] is not None:
                assert node not in seen
                seen.add(node)
                node = parents[node]
            assert node == roots[0]
            assert len(seen) <= n_ranks.bit_length()  # depth about log2 n
        children = {}
        for child, parent in parents.items():
            if parent is not None:
                children.setdefault(parent, []).append(child)
        assert max(len(c) for c in children.values()) <= 2
    inner = [{p for p in parents.values() if p is not None} for parents in diagrams.double_binary_tree(n_ranks)]
    assert not inner[0] & inner[1], "a rank must be a leaf in at least one of the two trees"


def test_nccl_btree_matches_the_picture_in_nccl_source():
    # src/graph/trees.cc draws 14 ranks: 0-8, 8-4/12, 4-2/6, 12-10/13, 2-1/3, 6-5/7, 10-9/11
    expected = {1: 2, 2: 4, 3: 2, 4: 8, 5: 6, 6: 4, 7: 6, 8: 0, 9: 10, 10: 12, 11: 10, 12: 8, 13: 12}
    assert {r: diagrams.nccl_btree_parent(r, 14) for r in range(1, 14)} == expected
    assert diagrams.nccl_btree_parent(0, 14) is None


@pytest.mark.parametrize("name", sorted(diagrams.FIGURES))
def test_every_figure_function_returns_a_figure_with_content(name):
    fig = diagrams.FIGURES[name]()
    assert isinstance(fig, Figure)
    assert any(ax.patches or ax.lines for ax in fig.axes)


def test_zero_bars_have_the_heights_of_the_formulas():
    fig = diagrams.zero_memory(n_params=7.5e9, world_sizes=(64,))
    (ax,) = fig.axes
    bars = [p for p in ax.patches if p.get_width() == pytest.approx(0.8)]
    assert len(bars) == 4 * 3  # four stages, three kinds each
    tops = sorted({round(b.get_y() + b.get_height(), 6) for b in bars})
    totals = sorted(round(zero_memory_per_gpu(7.5e9, 64, s).total / 1e9, 6) for s in range(4))
    assert totals[-1] in tops and totals[0] in tops
    assert totals == pytest.approx([1.875, 16.640625, 31.40625, 120.0])


@pytest.mark.parametrize("call,match", [
    (lambda: diagrams.ring_vs_tree(n_ranks=7), "n_ranks"), (lambda: diagrams.ring_vs_tree(n_ranks=64), "n_ranks"),
    (lambda: diagrams.node_topology(n_nodes=0), "n_nodes"), (lambda: diagrams.node_topology(gpus_per_node=6), "4 or 8"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_drawing_is_deterministic(tmp_path):
    first = {p.name: p.read_bytes() for p in diagrams.save_all(tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in diagrams.save_all(tmp_path / "b")}
    assert set(first) == set(diagrams.FIGURES)
    assert first == second


def test_book_figures_are_up_to_date():
    problems = make_figures.stale_figures(make_figures.FIGURE_DIR)
    assert not problems, "\n".join(problems) + "\nrun: .venv/bin/python scripts/make_figures.py"


def test_check_notices_a_stale_and_an_extra_figure(tmp_path):
    diagrams.save_all(tmp_path)
    plt.figure(figsize=(2, 2)).savefig(tmp_path / "ring_vs_tree.png")  # an outdated drawing
    (tmp_path / "old_figure.png").write_bytes((tmp_path / "cuda_stack.png").read_bytes())
    problems = make_figures.stale_figures(tmp_path)
    assert any(p.startswith("ring_vs_tree.png differs") for p in problems), problems
    assert any(p.startswith("old_figure.png") for p in problems), problems
    assert len(problems) == 2

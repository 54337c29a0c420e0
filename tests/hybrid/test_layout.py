"""Rank groups of a 3D (dp, pp, tp) layout: hand-checked pictures, Megatron-LM's example, and torch's own
init_device_mesh (on a fake process group for many shapes, on 4 real ranks through course_lib.runtime.launch)."""

import pytest
import torch
import torch.distributed as dist

from course_lib.hybrid import layout as mesh_layout
from course_lib.hybrid.layout import (
    DIMS,
    RankPlace,
    all_groups,
    check_tp_within_nodes,
    coordinates,
    node_of,
    parallel_sizes,
    rank_groups,
    rank_of,
    torch_mesh_groups,
)
from course_lib.runtime.launch import launch

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 1, 4), (2, 2, 2), (3, 2, 4), (4, 3, 2), (2, 4, 1), (1, 5, 3)]  # (dp, pp, tp)
ORDERS = [("dp", "pp", "tp"), ("pp", "dp", "tp"), ("tp", "pp", "dp")]


def test_two_by_two_by_two():
    places = rank_groups(8, tp=2, pp=2)
    assert places[5] == RankPlace(rank=5, dp=1, pp=0, tp=1, dp_group=(1, 5), pp_group=(5, 7), tp_group=(4, 5))
    assert all_groups(places, "tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]  # tp varies fastest: neighbours
    assert all_groups(places, "pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert all_groups(places, "dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]  # dp outermost: one replica per half


def test_megatron_docstring_example():
    # Megatron-LM's initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4 (its order: tp, then dp, then pp).
    places = rank_groups(16, tp=2, pp=4, order=("pp", "dp", "tp"))
    assert all_groups(places, "dp") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert all_groups(places, "tp") == [(2 * i, 2 * i + 1) for i in range(8)]
    assert all_groups(places, "pp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_groups_partition_the_ranks_and_coordinates_round_trip(shape, order):
    dp, pp, tp = shape
    world = dp * pp * tp
    places = rank_groups(world, tp=tp, pp=pp, order=order)
    sizes = parallel_sizes(world, tp, pp)
    assert [p.rank for p in places] == list(range(world))
    for dim in DIMS:
        groups = all_groups(places, dim)
        assert sorted(r for g in groups for r in g) == list(range(world)), f"{dim} groups must partition the ranks"
        assert {len(g) for g in groups} == {sizes[dim]}
    for p in places:
        coords = {"dp": p.dp, "pp": p.pp, "tp": p.tp}
        assert coordinates(p.rank, sizes, order) == coords and rank_of(coords, sizes, order) == p.rank
        for dim in DIMS:  # a group's members differ from this rank in that coordinate only
            others = [d for d in DIMS if d != dim]
            assert all(places[r].__getattribute__(d) == coords[d] for r in p.group(dim) for d in others)
            assert [getattr(places[r], dim) for r in p.group(dim)] == list(range(sizes[dim]))


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_equals_the_device_mesh_tensor_at_1024_ranks(order):
    """DeviceMesh lays ranks out as torch.arange(world).reshape(shape): slices along a dimension are its groups."""
    sizes = {"dp": 16, "pp": 8, "tp": 8}
    mesh = torch.arange(1024).reshape([sizes[d] for d in order])
    places = rank_groups(1024, tp=8, pp=8, order=order)
    for axis, dim in enumerate(order):
        expected = sorted(tuple(row) for row in mesh.movedim(axis, -1).reshape(-1, sizes[dim]).tolist())
        assert all_groups(places, dim) == expected, dim


def _fake_process_group(rank: int, world_size: int):
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


@pytest.mark.parametrize("order", ORDERS[:2], ids="-".join)
def test_equals_init_device_mesh_on_a_fake_process_group(order):
    """torch's own init_device_mesh, for every rank of several shapes, without starting processes."""
    for dp, pp, tp in [(2, 2, 2), (2, 3, 4), (4, 2, 8)]:
        world = dp * pp * tp
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        places = rank_groups(world, tp=tp, pp=pp, order=order)
        for rank in range(world):
            _fake_process_group(rank, world)
            try:
                torch_says = torch_mesh_groups([sizes[d] for d in order], order)
            finally:
                dist.destroy_process_group()
            place = places[rank]
            assert torch_says["coords"] == {"dp": place.dp, "pp": place.pp, "tp": place.tp}, (rank, sizes)
            assert torch_says["groups"] == {d: place.group(d) for d in order}, (rank, sizes)


@pytest.mark.distributed
def test_equals_init_device_mesh_on_four_real_ranks(tmp_path):
    results = launch(torch_mesh_groups, 4, args=((2, 2), ("dp", "tp")), log_dir=tmp_path, echo=False,
                     threads_per_rank=1)
    places = rank_groups(4, tp=2, pp=1)
    for rank, torch_says in enumerate(results):
        assert torch_says["mesh"] == [[0, 1], [2, 3]]
        assert torch_says["coords"] == {"dp": places[rank].dp, "tp": places[rank].tp}
        assert torch_says["groups"] == {"dp": places[rank].dp_group, "tp": places[rank].tp_group}


def test_tp_groups_stay_inside_nodes_only_when_tp_is_fastest():
    assert [node_of(r, 8) for r in (0, 7, 8, 1023)] == [0, 0, 1, 127]
    check_tp_within_nodes(rank_groups(1024, tp=8, pp=8), gpus_per_node=8)  # 128 nodes x 8: fine
    check_tp_within_nodes(rank_groups(1024, tp=4, pp=4, order=("pp", "dp", "tp")), gpus_per_node=8)
    with pytest.raises(ValueError, match=r"tensor-parallel group \[0, 1, .*15\] spans nodes \[0, 1\]"):
        check_tp_within_nodes(rank_groups(64, tp=16, pp=1), gpus_per_node=8)
    with pytest.raises(ValueError, match="spans nodes"):  # tp outermost: a TP group strides across nodes
        check_tp_within_nodes(rank_groups(64, tp=8, pp=2, order=("tp", "dp", "pp")), gpus_per_node=8)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: rank_groups(12, tp=5, pp=1), r"world_size \(12\) is not divisible by tp \* pp"),
    (lambda: rank_groups(8, tp=2, pp=2, dp=4), r"world_size \(8\) must equal dp \* tp \* pp = 4 \* 2 \* 2 = 16"),
    (lambda: rank_groups(8, tp=0, pp=2), "tp must be a positive integer"),
    (lambda: rank_groups(8, tp=2, pp=2, order=("dp", "tp", "tp")), "order must name each of"),
    (lambda: coordinates(8, {"dp": 2, "pp": 2, "tp": 2}), r"rank 8 is outside 0\.\.7"),
    (lambda: node_of(3, 0), "gpus_per_node must be a positive integer"),
    (lambda: RankPlace(0, 0, 0, 0, (0,), (0,), (0,)).group("cp"), "unknown parallel dimension 'cp'"),
])
def test_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_rank_place_accepts_lists():
    assert RankPlace(3, 1, 0, 1, [1, 3], [3], [2, 3]) == RankPlace(3, 1, 0, 1, (1, 3), (3,), (2, 3))


def test_command_line(capsys):
    mesh_layout.main(["--world-size", "16", "--tp", "2", "--pp", "4", "--order", "pp", "dp", "tp",
                      "--gpus-per-node", "8"])
    out = capsys.readouterr().out
    assert "dp 2 x pp 4 x tp 2" in out and "every tensor-parallel group sits inside one node" in out
    assert any(line.split()[:2] == ["5", "(0,1,1)"] for line in out.splitlines()), out

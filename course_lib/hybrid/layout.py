"""Which ranks talk to which: the data, pipeline and tensor groups of a 3D-parallel job.

A job of W = dp * pp * tp ranks is a 3D grid (a device mesh). Each rank has one coordinate per dimension,
and the ranks that differ from it in one coordinate only form its group of that kind: the tensor-parallel
group shares every layer's matrices, the pipeline group holds the successive stages of the model, the
data-parallel group holds replicas that see different data. Ranks are laid out in the grid like
torch.arange(W).reshape(sizes in `order`), as torch's init_device_mesh does, so the last dimension of
`order` varies fastest:

    rank = (d * pp + p) * tp + t          for the default order ("dp", "pp", "tp")

tp varies fastest, so a tensor-parallel group is tp consecutive ranks: one node's NVLink-connected GPUs
when tp divides the GPUs per node (ranks are numbered node by node; see course_lib.cluster.slurm). Megatron-LM
and torchtitan also put tp last but put pp first, order ("pp", "dp", "tp"); both orders are supported.

    python -m course_lib.hybrid.layout --world-size 8 --tp 2 --pp 2
    python -m course_lib.hybrid.layout --world-size 16 --tp 2 --pp 4 --order pp dp tp --gpus-per-node 8
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from course_lib.core.checks import positive_int

DIMS = ("dp", "pp", "tp")
DEFAULT_ORDER = ("dp", "pp", "tp")
"""Mesh dimensions from slowest- to fastest-varying: data parallel outermost, tensor parallel innermost."""


@dataclass(frozen=True)
class RankPlace:
    """One rank's coordinates in the mesh and the ranks of its three groups (itself included, in rank order)."""

    rank: int
    dp: int
    pp: int
    tp: int
    dp_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    tp_group: tuple[int, ...]

    def __post_init__(self):
        for name in ("dp_group", "pp_group", "tp_group"):  # accept lists: a group is compared by its members
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def group(self, dim: str) -> tuple[int, ...]:
        return getattr(self, f"{_check_dim(dim)}_group")


def _check_dim(dim: str) -> str:
    if dim not in DIMS:
        raise ValueError(f"unknown parallel dimension {dim!r}; choose one of {DIMS}")
    return dim


def parallel_sizes(world_size: int, tp: int, pp: int, dp: int | None = None) -> dict[str, int]:
    """{'dp': ..., 'pp': ..., 'tp': ...}; dp defaults to world_size / (tp * pp). Raises if they do not multiply out."""
    positive_int("world_size", world_size)
    positive_int("tp", tp)
    positive_int("pp", pp)
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(f"world_size ({world_size}) is not divisible by tp * pp = {tp} * {pp} = {tp * pp}: "
                             "the ranks cannot be split into whole data-parallel replicas")
        dp = world_size // (tp * pp)
    positive_int("dp", dp)
    if dp * tp * pp != world_size:
        raise ValueError(f"world_size ({world_size}) must equal dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp}")
    return {"dp": dp, "pp": pp, "tp": tp}


def _check_order(order) -> tuple[str, ...]:
    order = tuple(order)
    if sorted(order) != sorted(DIMS):
        raise ValueError(f"order must name each of {DIMS} once (slowest- to fastest-varying), got {order!r}")
    return order


def mesh_shape(sizes: dict[str, int], order=DEFAULT_ORDER) -> tuple[int, ...]:
    """The shape to pass to init_device_mesh(device, shape, mesh_dim_names=order)."""
    return tuple(sizes[dim] for dim in _check_order(order))


def strides(sizes: dict[str, int], order=DEFAULT_ORDER) -> dict[str, int]:
    """How far apart in rank two neighbours along each dimension are (the fastest dimension has stride 1)."""
    order, stride, result = _check_order(order), 1, {}
    for dim in reversed(order):
        result[dim] = stride
        stride *= sizes[dim]
    return {dim: result[dim] for dim in order}


def coordinates(rank: int, sizes: dict[str, int], order=DEFAULT_ORDER) -> dict[str, int]:
    """{'dp': d, 'pp': p, 'tp': t} of `rank` (the inverse of rank_of)."""
    world_size = math.prod(sizes.values())
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    return {dim: rank // stride % sizes[dim] for dim, stride in strides(sizes, order).items()}


def rank_of(coords: dict[str, int], sizes: dict[str, int], order=DEFAULT_ORDER) -> int:
    """The rank at mesh coordinates `coords`: sum of coordinate * stride."""
    return sum(coords[dim] * stride for dim, stride in strides(sizes, order).items())


def rank_groups(world_size: int, tp: int, pp: int, dp: int | None = None, order=DEFAULT_ORDER) -> list[RankPlace]:
    """For every rank (list index = rank): its (dp, pp, tp) coordinates and the ranks of its three groups."""
    sizes = parallel_sizes(world_size, tp, pp, dp)
    order = _check_order(order)
    places = []
    for rank in range(world_size):
        coords = coordinates(rank, sizes, order)
        groups = {dim: tuple(rank_of({**coords, dim: i}, sizes, order) for i in range(sizes[dim])) for dim in DIMS}
        places.append(RankPlace(rank=rank, **coords, **{f"{dim}_group": groups[dim] for dim in DIMS}))
    return places


def all_groups(places: list[RankPlace], dim: str) -> list[tuple[int, ...]]:
    """The distinct groups of one kind, ordered by their first rank: every rank is in exactly one."""
    return sorted({place.group(dim) for place in places})


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node a global rank runs on when ranks are numbered node by node (torchrun, SLURM, course_lib.cluster.slurm)."""
    positive_int("gpus_per_node", gpus_per_node)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    return rank // gpus_per_node


def nodes_spanned(group, gpus_per_node: int) -> list[int]:
    """The nodes a group's ranks sit on, in order."""
    return sorted({node_of(rank, gpus_per_node) for rank in group})


def check_tp_within_nodes(places: list[RankPlace], gpus_per_node: int) -> None:
    """Raise ValueError naming the first tensor-parallel group that spans two nodes.

    Tensor parallelism all-reduces activations several times per layer: it needs NVLink bandwidth, which a
    node has inside and the network between nodes has ~10x less of.
    """
    for group in all_groups(places, "tp"):
        nodes = nodes_spanned(group, gpus_per_node)
        if len(nodes) > 1:
            raise ValueError(f"tensor-parallel group {list(group)} spans nodes {nodes} ({gpus_per_node} GPUs per "
                             f"node): choose tp <= {gpus_per_node} dividing it, and put tp last in the order")


def format_layout(places: list[RankPlace], gpus_per_node: int | None = None) -> str:
    """A table: one line per rank with its coordinates, groups and (if gpus_per_node is given) node."""
    header = f"{'rank':>4} {'(dp,pp,tp)':>10}  {'dp group':<16}{'pp group':<16}{'tp group':<16}"
    lines = [(header + ("node" if gpus_per_node else "")).rstrip()]
    for p in places:
        line = f"{p.rank:>4} {f'({p.dp},{p.pp},{p.tp})':>10}  " + "".join(
            f"{str(list(p.group(dim))):<16}" for dim in DIMS)
        lines.append((line + (str(node_of(p.rank, gpus_per_node)) if gpus_per_node else "")).rstrip())
    return "\n".join(lines)


def torch_mesh_groups(shape, names=DEFAULT_ORDER, device: str = "cpu") -> dict:
    """What torch builds on a live process group: init_device_mesh(device, shape, mesh_dim_names=names).

    Call on every rank (under course_lib.runtime.launch, torchrun, or a fake process group in one process).
    Returns this rank's {'coords': {name: index}, 'groups': {name: (ranks...)}, 'mesh': nested rank lists}.

        launch(torch_mesh_groups, 4, args=((2, 2), ("dp", "tp")))
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(names)
    mesh = init_device_mesh(device, tuple(shape), mesh_dim_names=names)
    return {"coords": dict(zip(names, mesh.get_coordinate())),
            "groups": {name: tuple(dist.get_process_group_ranks(mesh.get_group(name))) for name in names},
            "mesh": mesh.mesh.tolist()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--order", nargs=3, default=list(DEFAULT_ORDER), metavar="DIM",
                        help="mesh dimensions, slowest- to fastest-varying (default: dp pp tp)")
    parser.add_argument("--gpus-per-node", type=int, default=None)
    args = parser.parse_args(argv)
    places = rank_groups(args.world_size, args.tp, args.pp, order=args.order)
    sizes = parallel_sizes(args.world_size, args.tp, args.pp)
    print(f"world_size {args.world_size} = dp {sizes['dp']} x pp {sizes['pp']} x tp {sizes['tp']}, "
          f"order {' '.join(args.order)} (slowest to fastest), strides {strides(sizes, args.order)}")
    print(format_layout(places, args.gpus_per_node))
    if args.gpus_per_node:
        check_tp_within_nodes(places, args.gpus_per_node)
        print(f"every tensor-parallel group sits inside one node of {args.gpus_per_node} GPUs")


if __name__ == "__main__":
    main()

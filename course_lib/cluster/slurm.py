"""What a cluster tells each process, turned into what torch.distributed reads.

    node_rank_range(node_rank=3, nproc_per_node=4)            ->  range(12, 16)
    expand_nodelist("gpu[001-004,007]")                        ->  ['gpu001', ..., 'gpu004', 'gpu007']
    slurm_to_torch_env(os.environ)                             ->  {'RANK': ..., 'MASTER_ADDR': 'gpu001', ...}

SLURM starts one task per GPU (srun --ntasks-per-node=G) and sets SLURM_PROCID (global rank), SLURM_LOCALID
(rank on the node), SLURM_NODEID (node index), SLURM_NTASKS (world size) and SLURM_JOB_NODELIST (compressed
host names). torch needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the first host of the
allocation serves the rendezvous.
"""

from __future__ import annotations

import itertools
import re

DEFAULT_PORT_BASE = 29500


def node_rank_range(node_rank: int, nproc_per_node: int, nnodes: int | None = None) -> range:
    """Global ranks of node `node_rank` (0-based) when every node runs nproc_per_node processes."""
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    if node_rank < 0 or (nnodes is not None and node_rank >= nnodes):
        raise ValueError(f"node_rank {node_rank} is not a node of a {nnodes}-node job (0..{(nnodes or 1) - 1})")
    start = node_rank * nproc_per_node
    return range(start, start + nproc_per_node)


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in nodelist {text!r}")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"unbalanced '[' in nodelist {text!r}")
    parts.append(current)
    return [p for p in parts if p]


def _expand_range_list(spec: str, nodelist: str) -> list[str]:
    """'001-003,007' -> ['001', '002', '003', '007'] (zero padding kept)."""
    values = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise ValueError(f"cannot read range {item!r} in nodelist {nodelist!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {item!r} in nodelist {nodelist!r} runs backwards")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list ('gpu[001-004,007]', 'a[1-2]-b[3-4]', 'n1,n2') in order."""
    if not nodelist or not nodelist.strip():
        raise ValueError("nodelist is empty")
    hosts = []
    for part in _split_top_level(nodelist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)  # literal text and [ranges], alternating
        options = [_expand_range_list(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p]
        hosts += ["".join(combo) for combo in itertools.product(*options)]
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE: '4(x2),2' -> [4, 4, 2]."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE item {item!r} in {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _require(environ, name: str) -> str:
    if name not in environ:
        raise KeyError(f"{name} is not set: run this inside a SLURM job step (srun), or set it to simulate one")
    return environ[name]


def slurm_to_torch_env(environ, master_port: int | None = None) -> dict[str, str]:
    """Map a SLURM task's variables to torch.distributed's (RANK, LOCAL_RANK, WORLD_SIZE, ...).

    MASTER_PORT: `master_port`, else MASTER_PORT if already set, else 29500 + (SLURM_JOB_ID % 1000), so two
    jobs sharing a first node do not collide.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or _require(environ, "SLURM_NODELIST")
    hosts = expand_nodelist(nodelist)
    world_size = int(_require(environ, "SLURM_NTASKS"))
    node_id = int(_require(environ, "SLURM_NODEID"))
    if not 0 <= node_id < len(hosts):
        raise ValueError(f"SLURM_NODEID={node_id} but SLURM_JOB_NODELIST={nodelist!r} has {len(hosts)} hosts")
    if "SLURM_TASKS_PER_NODE" in environ:
        local_world_size = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])[node_id]
    else:
        local_world_size = world_size // len(hosts)
    if master_port is None:
        master_port = int(environ.get("MASTER_PORT") or DEFAULT_PORT_BASE + int(environ.get("SLURM_JOB_ID", 0)) % 1000)
    return {
        "RANK": _require(environ, "SLURM_PROCID"),
        "LOCAL_RANK": _require(environ, "SLURM_LOCALID"),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_id),
        "NNODES": str(len(hosts)),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or hosts[0],
        "MASTER_PORT": str(master_port),
    }

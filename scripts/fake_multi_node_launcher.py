"""Lab 3: a simulated multi-node job on one machine — what SLURM + torchrun do on a real cluster.

Every "node" is its own process tree that knows only what a cluster gives a node: NODE_RANK, NNODES,
NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT. It starts NPROC_PER_NODE ranks, each with

    RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK        WORLD_SIZE = NNODES * NPROC_PER_NODE

and the ranks find each other through torch.distributed's real rendezvous: global rank 0 serves a TCPStore at
MASTER_ADDR:MASTER_PORT and everyone else connects to it (nothing is shared in Python).

    # the whole job, 2 nodes x 2 ranks, from one terminal
    python scripts/fake_multi_node_launcher.py --nnodes 2 --nproc_per_node 2

    # or as on a cluster, one node per terminal (seed 002's form)
    export NNODES=2 NPROC_PER_NODE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512
    NODE_RANK=0 python scripts/fake_multi_node_launcher.py          # terminal 1
    NODE_RANK=1 python scripts/fake_multi_node_launcher.py          # terminal 2

    # any rank program: a module (-m) or a script, with its own arguments after it
    python scripts/fake_multi_node_launcher.py --nnodes 2 --nproc_per_node 2 -m course_lib.train --strategy ddp --max_steps 20

Without a program the ranks run course_lib.cluster.multinode_demo (identity, all_reduce, barrier). Every output line
is prefixed with [node n | local l | rank r]; logs go to logs/rank_<r>/. If any rank fails, its node stops
its other ranks and exits non-zero, and the launcher stops the other nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

DEMO = ["-m", "course_lib.cluster.multinode_demo"]


def _env_default(name: str, default=None, cast=str):
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return cast(value)
    except ValueError:
        raise SystemExit(f"environment variable {name}={value!r} is not a valid {cast.__name__}") from None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--nnodes", type=int, default=_env_default("NNODES", 2, int))
    parser.add_argument("--nproc_per_node", type=int, default=_env_default("NPROC_PER_NODE", 2, int))
    parser.add_argument("--node_rank", type=int, default=_env_default("NODE_RANK", None, int),
                        help="start only this node (default: $NODE_RANK; unset: start every node)")
    parser.add_argument("--master_addr", default=_env_default("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master_port", type=int, default=_env_default("MASTER_PORT", None, int),
                        help="default: $MASTER_PORT, else a free port (whole-job mode only)")
    parser.add_argument("--log_dir", default="logs")
    parser.add_argument("program", nargs=argparse.REMAINDER,
                        help="-m module [args] or script.py [args] that every rank runs (default: the demo)")
    args = parser.parse_args(argv)
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        parser.error(f"NODE_RANK={args.node_rank} is not a node of a {args.nnodes}-node job (0..{args.nnodes - 1})")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, log_file) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()
        if log_file:
            log_file.write(line)
            log_file.flush()


def _stop(procs, sig=signal.SIGTERM, grace: float = 3.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _supervise(procs, names) -> int:
    """Wait for all; if one fails, stop the rest. Returns the first failure's exit code (0 if none)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(name, code) for name, code in zip(names, codes) if code not in (None, 0)]
        if failed:
            name, code = failed[0]
            print(f"[launcher] {name} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
            _stop(procs)
            return code if code > 0 else 128 - code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


def run_node(args) -> int:
    """One node: start NPROC_PER_NODE ranks with their torch.distributed variables."""
    world_size = args.nnodes * args.nproc_per_node
    program = args.program or DEMO
    procs, names, pumps = [], [], []
    for local_rank in range(args.nproc_per_node):
        rank = args.node_rank * args.nproc_per_node + local_rank
        env = dict(os.environ, NODE_RANK=str(args.node_rank), NNODES=str(args.nnodes),
                   NPROC_PER_NODE=str(args.nproc_per_node), MASTER_ADDR=args.master_addr,
                   MASTER_PORT=str(args.master_port), RANK=str(rank), LOCAL_RANK=str(local_rank),
                   WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(args.nproc_per_node),
                   GROUP_RANK=str(args.node_rank), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONUNBUFFERED="1")
        os.makedirs(os.path.join(args.log_dir, f"rank_{rank}"), exist_ok=True)
        log_file = open(os.path.join(args.log_dir, f"rank_{rank}", "stdout.log"), "w")
        proc = subprocess.Popen([sys.executable, *program], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        prefix = f"[node {args.node_rank} | local {local_rank} | rank {rank}]"
        pump = threading.Thread(target=_pump, args=(proc.stdout, prefix, log_file), daemon=True)
        pump.start()
        procs.append(proc)
        names.append(f"rank {rank} (node {args.node_rank}, local rank {local_rank})")
        pumps.append(pump)
    signal.signal(signal.SIGTERM, lambda *_: (_stop(procs), sys.exit(143)))
    code = _supervise(procs, names)
    for pump in pumps:
        pump.join(timeout=2)
    return code


def run_job(args) -> int:
    """Every node of the job, each as its own process tree (this script again, with NODE_RANK set)."""
    port = args.master_port or free_port()
    procs, names = [], []
    for node_rank in range(args.nnodes):
        env = dict(os.environ, NODE_RANK=str(node_rank), NNODES=str(args.nnodes),
                   NPROC_PER_NODE=str(args.nproc_per_node), MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
        cmd = [sys.executable, os.path.abspath(__file__), "--log_dir", args.log_dir, *args.program]
        procs.append(subprocess.Popen(cmd, env=env))
        names.append(f"node {node_rank}")
    try:
        return _supervise(procs, names)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.program and args.program[0] == "--":
        args.program = args.program[1:]
    if args.node_rank is None:
        return run_job(args)
    if args.master_port is None:
        print("MASTER_PORT is not set: every node of a job must use the same port (e.g. export MASTER_PORT=29512)",
              file=sys.stderr)
        return 2
    return run_node(args)


if __name__ == "__main__":
    sys.exit(main())

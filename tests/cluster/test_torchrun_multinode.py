"""Two torchrun agents on this machine forming one two-node job, as two cluster nodes would.

    .venv/bin/python -m pytest -q tests/cluster/test_torchrun_multinode.py

Each agent is started the way a node's launcher starts it (--nnodes=2 --node_rank=N --rdzv_backend=c10d
--rdzv_endpoint=127.0.0.1:<port> --rdzv_id=<job>), in its own session. `--local_addr` gives the two "nodes"
different addresses (127.0.0.1 and localhost, both the loopback interface on every OS, macOS included): the c10d
rendezvous orders nodes by address, and "127.0.0.1" sorts before "localhost", so node 0 gets the first global
ranks, as the first host of a real allocation does. Whatever
happens, every process a test started is killed before it ends (run_process_tree).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from course_lib.runtime.env import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIMEOUT_S = 120


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT")


def clean_environ(**extra) -> dict:
    """This process's environment without a surrounding job's variables (SLURM_*, torchrun's PET_*, RANK, ...)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARIABLES and not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))}
    return {**env, **extra}


def kill_process_trees(procs: list[subprocess.Popen], tag: str) -> None:
    """Stop every process these Popens started, and anything else carrying the environment tag.

    torchrun starts each worker in a session of its own, and a killed agent orphans its workers, so neither
    killpg nor the parent links are enough: collect descendants first, then every process whose environment
    carries COURSE_TEST_TAG=tag (each one a process this test started), then terminate them by pid.
    """
    victims = {}
    for proc in procs:
        try:
            parent = psutil.Process(proc.pid)
            victims.update({p.pid: p for p in [parent, *parent.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter():
        try:
            if p.pid not in victims and p.environ().get("COURSE_TEST_TAG") == tag:
                victims[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    for p in victims.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(victims.values()), timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_process_tree(commands: list[list], env: dict | None = None, cwd=None, timeout: float = TIMEOUT_S,
                     tag: str | None = None):
    """Start the commands side by side; wait; return [(exit code, stdout + stderr)] in order.

    Every process started carries COURSE_TEST_TAG=tag in its environment. A timeout, or any error, raises
    after every one of them has been killed (kill_process_trees).
    """
    tag = tag or uuid.uuid4().hex
    env = dict(env or clean_environ(), COURSE_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    logs = [open(Path(cwd or ".") / f".proc{i}-{tag[:8]}.log", "w+") for i in range(len(commands))]
    procs = []
    try:
        for command, log in zip(commands, logs):
            procs.append(subprocess.Popen([str(c) for c in command], env=env, cwd=cwd, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        results = []
        for proc, log in zip(procs, logs):
            log.seek(0)
            results.append((proc.returncode, log.read()))
        return results
    finally:
        kill_process_trees(procs, tag)
        for log in logs:
            log.close()
            os.unlink(log.name)


def two_node_commands(port: int, program: list[str], nproc_per_node: int = 1, extra: tuple = ()) -> list[list]:
    """The two nodes' torchrun command lines, node 1 first (start order must not matter).

    NODE_RANK is set per node as a cluster's node launcher would (course_lib.cluster.multinode_demo reads it).
    """
    return [["env", f"NODE_RANK={node}", TORCHRUN, "--nnodes=2", f"--node_rank={node}", f"--nproc_per_node={nproc_per_node}",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=job-{port}",
             f"--local_addr={NODE_ADDRESSES[node]}", *extra, *program] for node in (1, 0)]


NODE_ADDRESSES = ("127.0.0.1", "localhost")
"""Two names of the loopback interface that every OS has (macOS configures no 127.0.0.2), in c10d's sort order."""


JOINED = re.compile(r"joined: node (\d), local rank (\d), global rank (\d) of (\d)")


def test_two_agents_form_one_job_with_c10d_rendezvous(tmp_path):
    """2 nodes x 2 workers: every rank knows its place, the all_reduce is right, everyone passes the barrier."""
    env = clean_environ(NPROC_PER_NODE="2")  # course_lib.cluster.multinode_demo checks RANK = node * 2 + local rank
    (node1, out1), (node0, out0) = run_process_tree(
        two_node_commands(free_port(), ["-m", "course_lib.cluster.multinode_demo"], nproc_per_node=2), env=env,
        cwd=tmp_path)
    assert (node0, node1) == (0, 0), out0 + out1
    for out, node in ((out0, 0), (out1, 1)):
        joined = sorted(JOINED.findall(out))
        assert len(joined) == 2, out
        for node_seen, local, rank, world in joined:
            assert world == "4"
            assert int(rank) == 2 * node + int(local), out  # the first node holds the first global ranks
        assert out.count("all_reduce of ranks = 6 (correct)") == 2, out
        assert out.count("passed the barrier") == 2, out


def test_max_restarts_recovers_a_rank_that_fails_once(tmp_path):
    """Rank 1 crashes on attempt 0; both agents restart their workers; attempt 1 completes and exits 0."""
    # Without a fresh store per attempt the restarted workers can read their predecessors' addresses
    # (pytorch/pytorch#135712); the cluster files set the same variable.
    env = clean_environ(FAIL_RANK="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    (node1, out1), (node0, out0) = run_process_tree(
        two_node_commands(free_port(), ["-m", "course_lib.cluster.elastic_demo"], extra=("--max-restarts=1",)),
        env=env, cwd=tmp_path)
    assert (node0, node1) == (0, 0), out0 + out1
    # Node 1's agent restarted its failed worker: its count went to 1.
    assert "attempt 0: rank 1 fails on purpose" in out1, out1
    assert "attempt 1: rank 1 of 2" in out1 and "attempt 1: rank 1 finished (correct all_reduce)" in out1, out1
    # Node 0's agent restarted its worker too (its count is its own: 0 or 1, see course_lib.cluster.elastic_demo).
    assert len(re.findall(r"attempt \d: rank 0 of 2 .* joined", out0)) == 2, out0
    assert len(re.findall(r"attempt \d: rank 0 finished \(correct all_reduce\)", out0)) == 1, out0


def test_without_restarts_the_failure_ends_the_job(tmp_path):
    """The same crash with --max-restarts=0: both nodes exit non-zero and nobody finishes."""
    env = clean_environ(FAIL_RANK="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    (node1, out1), (node0, out0) = run_process_tree(
        two_node_commands(free_port(), ["-m", "course_lib.cluster.elastic_demo"], extra=("--max-restarts=0",)),
        env=env, cwd=tmp_path)
    assert node1 != 0 and node0 != 0, out0 + out1
    assert "finished" not in out0 + out1


def test_a_timed_out_job_leaves_no_process_behind(tmp_path):
    """The clean-up the tests above rely on: agents and their workers (own sessions) all end on a timeout."""
    tag = uuid.uuid4().hex
    command = [TORCHRUN, "--nproc_per_node=2", "--no-python", "bash", "-c", "touch started.$LOCAL_RANK; sleep 600"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_tree([command], cwd=tmp_path, timeout=10, tag=tag)
    assert (tmp_path / "started.0").exists() and (tmp_path / "started.1").exists()  # the workers did run
    survivors = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("COURSE_TEST_TAG") == tag:
                survivors.append(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    assert survivors == []

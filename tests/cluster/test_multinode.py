"""The simulated multi-node launcher: real rendezvous across separate node process trees."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
LAUNCHER = Path(__file__).resolve().parents[2] / "scripts" / "fake_multi_node_launcher.py"
JOINED = re.compile(r"\[node (\d) \| local (\d) \| rank (\d)\] joined: node (\d), local rank (\d), global rank (\d) of 4")


def check_four_ranks(output: str) -> None:
    joined = sorted(JOINED.findall(output))
    assert len(joined) == 4, output
    for node, local, rank, node2, local2, rank2 in joined:
        assert (node, local, rank) == (node2, local2, rank2)
        assert int(rank) == int(node) * 2 + int(local)
    assert output.count("all_reduce of ranks = 6 (correct)") == 4
    assert output.count("passed the barrier") == 4


def test_whole_job_two_nodes_two_ranks(tmp_path):
    done = subprocess.run([sys.executable, LAUNCHER, "--nnodes", "2", "--nproc_per_node", "2", "--log_dir", tmp_path],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    check_four_ranks(done.stdout)
    assert all((tmp_path / f"rank_{r}" / "stdout.log").exists() for r in range(4))


def test_one_node_per_terminal(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nodes = [subprocess.Popen([sys.executable, LAUNCHER, "--log_dir", tmp_path], env=dict(env, NODE_RANK=str(n)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (1, 0)]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    check_four_ranks("".join(outputs))


def test_bad_node_rank_is_refused():
    done = subprocess.run([sys.executable, LAUNCHER, "--nnodes", "2", "--node_rank", "2"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "NODE_RANK=2 is not a node of a 2-node job" in done.stderr

"""SLURM's variables and nodelists mapped to torch.distributed's, on the forms real clusters print."""

import pytest

from course_lib.cluster.slurm import expand_nodelist, expand_tasks_per_node, node_rank_range, slurm_to_torch_env


@pytest.mark.parametrize("nodelist,expected", [
    ("gpu001", ["gpu001"]),
    ("gpu[001-004,007]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("gpu[09-11]", ["gpu09", "gpu10", "gpu11"]),
    ("as01n01,as01n02", ["as01n01", "as01n02"]),
    ("gpu[1-2],cpu[10-11]", ["gpu1", "gpu2", "cpu10", "cpu11"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("nid00[2-3],nid0010", ["nid002", "nid003", "nid0010"]),
    ("ip-10-0-0-[5,7]", ["ip-10-0-0-5", "ip-10-0-0-7"]),
    ("as02r1b[05,16]", ["as02r1b05", "as02r1b16"]),
])
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu1-3]", "gpu[a-b]", "gpu[5-2]", ""])
def test_bad_nodelists_get_clear_errors(bad):
    with pytest.raises(ValueError, match="nodelist|range"):
        expand_nodelist(bad)


def test_tasks_per_node():
    assert expand_tasks_per_node("4(x2),2") == [4, 4, 2]
    assert expand_tasks_per_node("8") == [8]


def test_node_rank_range():
    assert node_rank_range(3, 4, nnodes=4) == range(12, 16)  # "node 3 of 4" with 4 GPUs each (0-based)
    assert list(node_rank_range(0, 2)) == [0, 1]
    with pytest.raises(ValueError, match="node_rank 4"):
        node_rank_range(4, 8, nnodes=4)


def test_slurm_to_torch_env():
    env = {"SLURM_PROCID": "13", "SLURM_LOCALID": "1", "SLURM_NODEID": "3", "SLURM_NTASKS": "16",
           "SLURM_JOB_NODELIST": "gpu[001-003,007]", "SLURM_TASKS_PER_NODE": "4(x4)", "SLURM_JOB_ID": "123456"}
    torch_env = slurm_to_torch_env(env)
    assert torch_env == {"RANK": "13", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4",
                         "NODE_RANK": "3", "NNODES": "4", "MASTER_ADDR": "gpu001", "MASTER_PORT": str(29500 + 456)}
    assert int(torch_env["RANK"]) in node_rank_range(3, 4)


def test_missing_variable_is_named():
    with pytest.raises(KeyError, match="SLURM_PROCID"):
        slurm_to_torch_env({"SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(ValueError, match="SLURM_NODEID=2"):
        slurm_to_torch_env({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "2",
                            "SLURM_JOB_NODELIST": "n[1-2]"})

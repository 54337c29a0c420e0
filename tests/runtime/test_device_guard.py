"""Every tensor course_lib hands to a collective is made on the rank's device (env.CUDA_BACKEND explains why).

The source guard runs over course_lib and scripts; the run-time guard is checked in one process with a declared
device that is not the CPU (`meta`), so a CPU tensor given to a collective must be refused.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib.runtime import device_guard
from course_lib.runtime.env import (CUDA_BACKEND, backend_uses_cuda, check_one_gpu_per_rank, default_backend,
                                    rank_device)
from course_lib.runtime.launch import DEVICE_GUARD_VARIABLE, launch
from course_lib.runtime.demo_workers import allreduce_demo
from course_lib.runtime.spawn import single_process_group

REPO_ROOT = Path(__file__).resolve().parents[2]

# The training CLI's loss logging before the fix: a CPU tensor all-reduced by an NCCL group on a GPU node.
OLD_TRAIN_LOSS = '''
def log_loss(stats, world_size):
    loss = torch.tensor([stats["loss"]], dtype=torch.float64)
    dist.all_reduce(loss)
    return loss.item() / world_size
'''


def test_every_collective_in_course_lib_and_scripts_gets_tensors_made_on_the_rank_device():
    findings = device_guard.host_tensor_collectives([REPO_ROOT / "course_lib", REPO_ROOT / "scripts"])
    assert not findings, "collectives fed tensors made on the host:\n" + "\n".join(findings)


@pytest.mark.parametrize("code", [
    OLD_TRAIN_LOSS,
    "def f(n):\n    parts = [torch.zeros(2) for _ in range(n)]\n    dist.all_gather(parts, torch.ones(2, device=d))\n",
    "def f(x):\n    y = x.detach().cpu()\n    dist.broadcast(y, src=0)\n",
    "def f(x):\n    torch.distributed.all_reduce(torch.tensor([x]))\n",
])
def test_the_source_guard_finds_host_tensors_given_to_collectives(code):
    findings = device_guard.host_tensor_collectives_in(code, "example.py")
    assert len(findings) == 1 and findings[0].startswith("example.py:"), findings


def test_the_source_guard_accepts_tensors_made_on_the_rank_device():
    code = OLD_TRAIN_LOSS.replace("dtype=torch.float64)", "dtype=torch.float64, device=device)")
    assert device_guard.host_tensor_collectives_in(code) == []
    assert device_guard.host_tensor_collectives_in("def f(p):\n    dist.all_reduce(p.grad)\n") == []


def test_the_run_time_guard_refuses_a_cpu_tensor_when_the_rank_device_is_another():
    with single_process_group():
        with device_guard.guard_collectives(torch.device("meta")):
            with pytest.raises(device_guard.DeviceMismatch, match=r"dist.all_reduce at .*test_device_guard.py:\d+ was "
                                                                  r"given a tensor on cpu, but this rank's device is meta"):
                dist.all_reduce(torch.ones(1))
        with device_guard.guard_collectives(torch.device("cpu")):
            tensor = torch.ones(2)
            dist.all_reduce(tensor)
        assert dist.all_reduce is not None and torch.equal(tensor, torch.ones(2))  # one rank: the sum is itself
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d", "the guard did not put dist back"


def test_the_guard_checks_batched_point_to_point_ops_and_keeps_them_batchable():
    original_isend, original_p2p_op = dist.isend, dist.P2POp
    with single_process_group(), device_guard.guard_collectives(torch.device("meta")):
        with pytest.raises(device_guard.DeviceMismatch, match="dist.isend at .* was given a tensor on cpu"):
            dist.P2POp(dist.isend, torch.ones(1), 0)
        op = dist.P2POp(dist.isend, torch.ones(1, device="meta"), 0)
        # batch_isend_irecv tells sends from receives by identity: the op must be torch's own isend
        assert op.op is original_isend and isinstance(op, original_p2p_op) and dist.isend == original_isend
    assert dist.P2POp is original_p2p_op and dist.isend is original_isend


def test_launch_runs_every_rank_under_the_guard_when_asked(monkeypatch):
    monkeypatch.setenv(DEVICE_GUARD_VARIABLE, "1")
    assert [r["after"] for r in launch(allreduce_demo, 2, echo=False)] == [3.0, 3.0]


def test_cuda_ranks_get_nccl_with_gloo_beside_it():
    assert default_backend("cuda") == CUDA_BACKEND == "cpu:gloo,cuda:nccl"
    assert default_backend("cpu") == "gloo"
    assert backend_uses_cuda(CUDA_BACKEND) and backend_uses_cuda("nccl") and not backend_uses_cuda("gloo")


def test_auto_takes_the_gpus_only_when_each_local_rank_has_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(1, "auto", local_world_size=2) == torch.device("cuda", 1)
    # 4 ranks on 2 GPUs: all on the CPU (never ranks 0-1 on GPUs and 2-3 on the CPU, which no backend joins)
    assert [rank_device(r, "auto", local_world_size=4) for r in range(4)] == [torch.device("cpu")] * 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert rank_device(0, "auto") == torch.device("cpu")


def test_nccl_with_more_ranks_than_gpus_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"2 ranks on this node but 1 GPU\(s\).*COURSE_BACKEND=gloo"):
        check_one_gpu_per_rank(CUDA_BACKEND, 2)
    check_one_gpu_per_rank("gloo", 2)  # gloo runs any number of ranks on one GPU's tensors
    check_one_gpu_per_rank(CUDA_BACKEND, 1)

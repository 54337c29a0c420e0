"""The course's CUDA paths, run by `make gpu-check` (pytest -m gpu) on a GPU node and skipped without CUDA.

Ranks on one GPU cannot use NCCL (one GPU per rank), so with fewer GPUs than ranks they use gloo on the CUDA
tensors: the device placement, the mixed "cpu:gloo,cuda:nccl" group and the device guard are still exercised.
"""

import pytest
import torch

from course_lib.core.model import GPT, GPTConfig
from course_lib.data_parallel.torch_ddp import train_and_accumulate
from course_lib.runtime.env import CUDA_BACKEND, get_dist_info
from course_lib.runtime.launch import DEVICE_GUARD_VARIABLE, launch
from course_lib.parity import global_batches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _backend(world_size: int) -> str:
    return CUDA_BACKEND if torch.cuda.device_count() >= world_size else "gloo"


def mixed_group_collectives() -> dict:
    """A rank of a "cpu:gloo,cuda:nccl" (or gloo) group: a CPU scalar, a CUDA tensor and a Python object reduced."""
    import torch.distributed as dist

    info = get_dist_info()
    on_cpu = torch.tensor([float(info.rank + 1)], dtype=torch.float64)
    on_gpu = torch.full((4,), float(info.rank + 1), device=info.device)
    dist.all_reduce(on_cpu)
    dist.all_reduce(on_gpu)
    objects = [None] * info.world_size
    dist.all_gather_object(objects, {"rank": info.rank, "device": str(info.device)})
    return {"cpu": on_cpu.item(), "gpu": on_gpu.cpu().tolist(), "gpu_device": on_gpu.device.type, "objects": objects}


def test_cpu_and_cuda_tensors_and_objects_reduce_in_one_group(tmp_path, monkeypatch):
    monkeypatch.setenv(DEVICE_GUARD_VARIABLE, "0")  # the CPU tensor is on purpose here: the guard would refuse it
    world_size = 2
    ranks = launch(mixed_group_collectives, world_size, device="cuda", backend=_backend(world_size),
                   log_dir=tmp_path / "logs", echo=False)
    total = world_size * (world_size + 1) / 2
    for rank, out in enumerate(ranks):
        assert out["cpu"] == total and out["gpu"] == [total] * 4 and out["gpu_device"] == "cuda"
        assert [o["rank"] for o in out["objects"]] == list(range(world_size))
        assert all(o["device"].startswith("cuda") for o in out["objects"])


def test_ddp_on_cuda_equals_one_process_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the ranks compute in full fp32 too
    micro_batch, accum, seq_len, world_size = 2, 3, 16, 2
    jobs = launch(train_and_accumulate, world_size, device="cuda", backend=_backend(world_size),
                  kwargs=dict(train_kwargs=dict(steps=2, micro_batch=2, seq_len=16, num_windows=8, log_every=1,
                                                data_dir=str(tmp_path / "data")),
                              accumulation_kwargs=dict(micro_batch=micro_batch, grad_accum_steps=accum,
                                                       seq_len=seq_len)),
                  log_dir=tmp_path / "logs", echo=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", block_size=seq_len)).cuda()
    batch = global_batches(1, micro_batch * accum * world_size, seq_len, 0)[0].cuda()
    model(batch, targets=batch)[1].backward()
    for job in jobs:
        for variant in ("no_sync", "sync_every_micro_batch"):
            for name, param in model.named_parameters():
                torch.testing.assert_close(job["accumulation"][variant]["grads"][name], param.grad.cpu(),
                                           rtol=1e-4, atol=1e-5, msg=f"{variant}: {name}")
    torch.testing.assert_close(jobs[0]["train"]["params"], jobs[1]["train"]["params"], rtol=0, atol=0)


def test_bf16_autocast_training_step_on_cuda_stays_close_to_fp32():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", block_size=64)).cuda()
    batch = global_batches(1, 8, 64, 0)[0].cuda()
    _, fp32 = model(batch, targets=batch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, bf16 = model(batch, targets=batch)
    assert bf16.dtype == torch.float32  # the loss is computed in fp32 under autocast
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=2e-2)

"""The multi-GPU suite: every parallel technique of the course on >= 2 GPUs over NCCL, each against one process.

    pytest -m multigpu tests/multigpu                             # on a node with >= 2 GPUs
    COURSE_MULTIGPU_ON_CPU=1 pytest -m multigpu tests/multigpu    # the same tests on 2 CPU ranks (gloo)

README. Every other distributed test of the course runs its ranks on the CPU over gloo; these tests run them where a
GPU node does, one rank per GPU (cuda:<local rank>) in the course's default process group for CUDA ranks,
"cpu:gloo,cuda:nccl" (course_lib.runtime.env.CUDA_BACKEND), so that every tensor the techniques communicate goes
through NCCL. Each test starts N = min(GPUs, what it needs) ranks with course_lib.runtime.launch (the torchrun CLI
test with `python -m torch.distributed.run`) and compares what they computed with one process on the CPU in fp32,
the reference the CPU parity tests use, within tolerances fit for GPU arithmetic (see TOLERANCES below). Before it
runs anything, each rank checks that its process group's backend is NCCL for CUDA tensors and that it sits on
cuda:<local rank>, and the device guard (COURSE_DEVICE_GUARD) makes every dist.* collective refuse a tensor that is
not on the GPU (in every test but the pipeline's: dist.P2POp refuses the guard's wrapped dist.isend); a rank still
busy after its deadline writes its Python stack to its log and exits, so a hang (a send and a receive waiting for
each other) fails the test in minutes instead of blocking the run. The tests: torch DDP (training steps and no_sync
accumulation), the course's ring all-reduce over NCCL send/recv, FSDP2, ZeRO stages 1-3 from scratch, DTensor tensor
parallelism (with and without sequence parallelism), pipeline parallelism with the 1F1B schedule over NCCL
point-to-point messages, and `python -m course_lib.train --strategy ddp` under torchrun against the one-process CLI.
Without 2 GPUs every test is skipped with the reason "needs >= 2 CUDA GPUs for NCCL; this machine has N", before any
rank starts. COURSE_MULTIGPU_ON_CPU=1 runs the same tests with 2 CPU ranks on gloo (each rank then checks for gloo
on the CPU instead): it proves the tests' own logic on a laptop, but not NCCL. Rank logs are in the test's tmp_path:
logs/rank_<r>/train.log (rank_logs/ for the CLI).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
CPU_MODE_VARIABLE = "COURSE_MULTIGPU_ON_CPU"
"""Set to 1: run the suite on 2 CPU ranks over gloo, whatever GPUs the machine has."""
CPU_RANKS = 2
DEADLINE_S = 300.0  # per launch: a rank still running its calls after this long dumps its stack and exits
COLLECTIVE_TIMEOUT_S = 120.0

TOLERANCES = {
    # Losses are means over thousands of logits: fp32 rounding on a GPU moves them by ~1e-6 relative.
    "loss": dict(rtol=1e-4, atol=1e-5),
    # Logits of the tiny model are O(1).
    "logits": dict(rtol=1e-4, atol=1e-4),
    # Gradients: relative to each tensor's largest entry (entries near zero are what is left of sums that cancel).
    "grad_rtol": 1e-4, "grad_atol_of_max": 1e-4,
    # Parameters after SGD steps: the update is linear in the gradient, so its rounding stays as small.
    "sgd_params": dict(rtol=1e-4, atol=1e-5),
    # Parameters after AdamW steps: atol = lr / 10, and a few outliers (see assert_adamw_params_close).
    "adamw_outlier_fraction": 1e-4,
}


def cpu_mode() -> bool:
    return os.environ.get(CPU_MODE_VARIABLE) == "1"


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason() -> str | None:
    """Why the suite cannot run here (None: it can)."""
    if cpu_mode():
        return None
    count = gpu_count()
    return None if count >= 2 else f"needs >= 2 CUDA GPUs for NCCL; this machine has {count}"


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


# ------------------------------------------------------------------------------------------------ comparisons
def _where(where: str, name: str = "") -> str:
    return ": ".join(part for part in (where, name) if part)


def assert_losses_close(got, want, where: str = "") -> None:
    """Per-step losses (Python floats or tensors) of a parallel run and of one process."""
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               **TOLERANCES["loss"], msg=lambda m: f"{_where(where, 'losses')}: {m}")


def assert_grads_close(got: dict, want: dict, where: str = "") -> None:
    """Gradients by parameter name; atol is taken relative to each reference tensor's largest entry."""
    assert set(got) == set(want), f"{_where(where)}: parameter names differ: {sorted(set(got) ^ set(want))}"
    for name, reference in want.items():
        atol = TOLERANCES["grad_atol_of_max"] * reference.abs().max().item() + 1e-12
        torch.testing.assert_close(got[name], reference, rtol=TOLERANCES["grad_rtol"], atol=atol,
                                   msg=lambda m, name=name: f"{_where(where, 'gradient of ' + name)}: {m}")


def assert_sgd_params_close(got: dict, want: dict, where: str = "", names=None) -> None:
    """Parameters after SGD steps (names: the ones to compare, default all of want's)."""
    for name in names or want:
        torch.testing.assert_close(got[name], want[name], **TOLERANCES["sgd_params"],
                                   msg=lambda m, name=name: f"{_where(where, name)}: {m}")


def assert_adamw_params_close(got: dict, want: dict, lr: float, steps: int, where: str = "") -> None:
    """Parameters after `steps` AdamW steps of learning rate lr.

    AdamW moves a weight by lr * m / (sqrt(v) + eps) per step: about lr, whatever the gradient's size. A gradient
    entry that is itself ~eps (what is left of a sum whose terms cancel) is mostly rounding, and a GPU rounds
    differently from the CPU: such an entry may move by a visibly different amount, up to a few lr. A wrong
    gradient moves most entries by ~lr. So: every entry within lr / 10 (+ rtol 1e-4) of one process, except at
    most a fraction TOLERANCES["adamw_outlier_fraction"] of all entries (at least 2), and none by more than
    4 lr per step (more than rounding through Adam can explain).
    """
    assert set(got) == set(want), f"{_where(where)}: parameter names differ: {sorted(set(got) ^ set(want))}"
    total, count, outliers, worst = 0, 0, [], 0.0
    for name, reference in want.items():
        diff = (got[name].double() - reference.double()).abs()
        total += diff.numel()
        worst = max(worst, diff.max().item())
        bad = int((diff > lr / 10 + 1e-4 * reference.double().abs()).sum())
        if bad:
            count += bad
            outliers.append(f"{name}: {bad} entries, largest {diff.max().item():.3g}")
    allowed = max(2, int(total * TOLERANCES["adamw_outlier_fraction"]))
    assert worst <= 4 * lr * steps, (f"{_where(where)}: a parameter differs by {worst:.3g} after {steps} AdamW "
                                     f"steps of lr {lr:g} (outliers: {outliers})")
    assert count <= allowed, (f"{_where(where)}: {count} of {total} parameter entries differ by more than "
                              f"lr / 10 = {lr / 10:g} ({allowed} allowed): {outliers}")


# ------------------------------------------------------------------------------------------------ the suite
class MultiGPU:
    """What every test of the suite needs: the mode, how many ranks, and a launch that checks where they ran."""

    def __init__(self):
        self.on_cpu = cpu_mode()
        self.device_type = "cpu" if self.on_cpu else "cuda"
        self.available = CPU_RANKS if self.on_cpu else gpu_count()

    def world_size(self, *sizes: int) -> int:
        """The largest of `sizes` (the world sizes the test's batches and model split into) that this machine has
        ranks for: min(GPUs, what the test needs)."""
        fitting = [size for size in sizes if 2 <= size <= self.available]
        if not fitting:
            pytest.skip(f"needs {min(sizes)} ranks; this machine has {self.available} "
                        f"{'CPU rank(s) in CPU mode' if self.on_cpu else 'GPU(s)'}")
        return max(fitting)

    def launch(self, calls: dict, world_size: int, tmp_path: Path, *, device_guard: bool = True) -> list[dict]:
        """Run calls ({name: (worker, kwargs)}) in turn on world_size ranks: NCCL on cuda:<local rank>, or gloo on
        the CPU in CPU mode. Each rank first checks that it is there (course_lib.parallel.multigpu_workers). Returns,
        per rank, {name: result}.

        device_guard: every dist.* collective refuses a tensor that is not on the rank's device
        (course_lib.runtime.device_guard).
        """
        from course_lib.parallel.multigpu_workers import on_rank_device
        from course_lib.runtime.env import CUDA_BACKEND
        from course_lib.runtime.launch import DEVICE_GUARD_VARIABLE, RankFailure, launch

        backend = "gloo" if self.on_cpu else CUDA_BACKEND  # named: a COURSE_BACKEND in the environment must not win
        try:
            ranks = launch(on_rank_device, world_size, args=(calls,),
                           kwargs=dict(expect=self.device_type, deadline_s=DEADLINE_S),
                           backend=backend, device=self.device_type, timeout_s=COLLECTIVE_TIMEOUT_S,
                           log_dir=tmp_path / "logs", echo=False, threads_per_rank=1 if self.on_cpu else None,
                           env={DEVICE_GUARD_VARIABLE: "1" if device_guard else "0"})
        except RankFailure as failure:
            if hasattr(failure, "add_note"):  # Python >= 3.11
                failure.add_note(f"{world_size} ranks, backend {backend!r}, device {self.device_type}; rank logs in "
                                 f"{tmp_path / 'logs'}; a rank that exited with code 1 after a 'Timeout' stack dump "
                                 f"was still running after the {DEADLINE_S:g} s deadline (a hang)")
            raise
        for rank, result in enumerate(ranks):
            placement = result["placement"]
            assert placement["rank"] == rank and placement["world_size"] == world_size, placement
            if self.on_cpu:
                assert placement["backend"] == "gloo" and placement["device"] == "cpu", placement
            else:
                assert "nccl" in placement["backend"] and placement["device"] == f"cuda:{rank}", placement
                assert "NCCL" in placement["cuda_backend"], placement
                assert result["peak_cuda_bytes"] > 0, f"rank {rank} allocated nothing on its GPU"
        return [result["results"] for result in ranks]

    assert_losses_close = staticmethod(assert_losses_close)
    assert_grads_close = staticmethod(assert_grads_close)
    assert_sgd_params_close = staticmethod(assert_sgd_params_close)
    assert_adamw_params_close = staticmethod(assert_adamw_params_close)


@pytest.fixture(scope="session")
def multigpu() -> MultiGPU:
    return MultiGPU()

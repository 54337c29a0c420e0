"""Ranks and their environment: who am I, how many are we, which device and backend.

The same worker code runs under three launchers, and reads the same variables from each:

    torchrun --nproc_per_node=2 scripts/ddp_simulation_train.py      # torchrun sets RANK, WORLD_SIZE, ...
    python scripts/ddp_simulation_train.py                            # one process, world size 1
    course_lib.runtime.launch.launch(worker, world_size=2)                    # from a notebook cell

`init_distributed()` reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT,
picks gloo on CPU and nccl on CUDA, and always passes a timeout: a hung collective then fails after
`timeout_s` seconds instead of torch's 30-minute default.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
"""Collective timeout of CPU (gloo) groups: a laptop's hung collective fails within a minute."""
NCCL_TIMEOUT_S = 600.0
"""Collective timeout of groups with NCCL: a cluster's first collective may wait for slow nodes, loading or
compilation on other ranks (torch's own default for NCCL is 10 minutes as well)."""
LOG_FORMAT = "%(asctime)s [rank {rank}/{world_size}] %(levelname)s %(message)s"


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it), for a launcher's rendezvous:
    `torchrun --master_port` or `accelerate launch --main_process_port`, so two runs never meet on 29500."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchEnvironmentError(RuntimeError):
    """A variable a launcher sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) is missing or wrong: bad input,
    which the training CLI reports in one line with exit code 2, like a bad flag."""


GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
LOOPBACK_ADDRESSES = ("127.0.0.1", "localhost", "::1")


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface: "lo" on Linux, "lo0" on macOS (None if not found)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def gloo_on_loopback(master_addr: str | None) -> dict[str, str]:
    """{GLOO_SOCKET_IFNAME: the loopback interface} when every rank runs on this machine (master_addr is a
    loopback address) and the variable is not set; {} otherwise.

    gloo finds the address it listens on from the host name. On a laptop whose host name resolves to a VPN's or a
    Wi-Fi network's address (common on macOS), the ranks then try to reach each other there, and the process group
    fails or hangs; ranks of one machine need only the loopback interface.
    """
    if os.environ.get(GLOO_INTERFACE_VARIABLE) or master_addr not in LOOPBACK_ADDRESSES:
        return {}
    interface = loopback_interface()
    return {GLOO_INTERFACE_VARIABLE: interface} if interface else {}


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise LaunchEnvironmentError(f"environment variable {name} is not set (a launcher such as torchrun sets it)")
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvironmentError(f"environment variable {name} must be an integer, got {value!r}") from None


CUDA_BACKEND = "cpu:gloo,cuda:nccl"
BACKEND_VARIABLE = "COURSE_BACKEND"
"""Overrides the default backend, e.g. gloo for several ranks on one GPU (NCCL needs one GPU per rank)."""
"""The process group of CUDA ranks: NCCL for tensors on the GPUs, gloo for CPU tensors and Python objects.

An NCCL-only group cannot run a collective on a CPU tensor ("No backend type associated with device type
cpu"); with both, such a collective still works (slowly, through gloo), and the course's own code keeps every
tensor it communicates on the rank's device (tests/runtime/test_device_guard.py checks it). torchtitan does
the same when it needs both."""


def default_backend(device: torch.device | str) -> str:
    """NCCL for CUDA tensors with gloo beside it for CPU ones (CUDA_BACKEND) on CUDA devices; gloo on the CPU."""
    return CUDA_BACKEND if torch.device(device).type == "cuda" else "gloo"


def backend_uses_cuda(backend: str) -> bool:
    """True for a process group whose tensors live on GPUs: "nccl", or a per-device one such as CUDA_BACKEND."""
    return "nccl" in backend


def rank_device(local_rank: int, device: str = "auto", local_world_size: int | None = None) -> torch.device:
    """One GPU per local rank when CUDA is there (and asked for); the CPU otherwise.

    "auto" takes the GPUs only when the node has one for each of its local_world_size ranks (default: the
    LOCAL_WORLD_SIZE variable that torchrun and launch set): 2 ranks on a 1-GPU machine all use the CPU rather
    than one rank on the GPU and one on the CPU, which no backend can join.
    """
    if device == "auto":
        ranks_here = local_world_size or _env_int("LOCAL_WORLD_SIZE", local_rank + 1)
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks_here else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but torch.cuda.is_available() is False")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return torch.device("cpu")


def check_one_gpu_per_rank(backend: str, local_world_size: int) -> None:
    """NCCL needs a GPU of its own for each rank: say so before NCCL fails with a message about duplicate GPUs."""
    if backend_uses_cuda(backend) and torch.cuda.is_available() and local_world_size > torch.cuda.device_count():
        raise LaunchEnvironmentError(
            f"{local_world_size} ranks on this node but {torch.cuda.device_count()} GPU(s): backend {backend!r} "
            f"(NCCL) needs one GPU per rank. Start at most {torch.cuda.device_count()} rank(s) per node, use "
            f"device='cpu' (--device cpu), or put the ranks on gloo with {BACKEND_VARIABLE}=gloo")


def get_dist_info() -> DistInfo:
    """This process's place in the job; world size 1 when nothing was launched."""
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    else:
        rank, world_size, backend = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), "none"
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    device_kind = "cuda" if backend_uses_cuda(backend) else os.environ.get("COURSE_DEVICE", "cpu")
    return DistInfo(rank, world_size, local_rank, local_world_size, backend,
                    rank_device(local_rank, device_kind, local_world_size))


def exit_with_parent() -> None:
    """Under torchrun: die when the agent that started this rank dies (SIGKILL included), as launch()'s ranks do.

    Without it, ranks whose agent was killed keep training (and writing metrics and checkpoints) with nobody to
    stop them. Linux's parent-death signal does it at once; elsewhere a thread checks the parent once a second.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before the signal was armed
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def init_distributed(backend: str | None = None, device: str = "auto", timeout_s: float | None = None,
                     store: dist.Store | None = None) -> DistInfo:
    """Join the process group described by the environment (or a 1-rank group when there is none).

    `store` lets a launcher that already runs a TCPStore hand it over; otherwise MASTER_ADDR and
    MASTER_PORT (env://) are used, as under torchrun. timeout_s: how long a collective may wait before it fails;
    None: NCCL_TIMEOUT_S (10 minutes) with NCCL, DEFAULT_TIMEOUT_S (1 minute) on gloo alone.
    """
    if dist.is_initialized():
        return get_dist_info()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by a torchrun agent
        exit_with_parent()
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world_size < 1:
        raise LaunchEnvironmentError(f"environment variable WORLD_SIZE must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise LaunchEnvironmentError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size}): every rank "
                                     "of a job needs its own RANK below WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    torch_device = rank_device(local_rank, device, local_world_size)
    backend = backend or os.environ.get(BACKEND_VARIABLE) or default_backend(torch_device)
    check_one_gpu_per_rank(backend, local_world_size)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    os.environ["COURSE_DEVICE"] = torch_device.type
    if timeout_s is None:
        timeout_s = NCCL_TIMEOUT_S if backend_uses_cuda(backend) else DEFAULT_TIMEOUT_S
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif world_size == 1 and "MASTER_ADDR" not in os.environ:
        # A plain `python script.py`: a one-rank group so the same code paths (all_reduce, barrier) run.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise LaunchEnvironmentError(
                    f"environment variable {name} is not set; WORLD_SIZE={world_size} needs a rendezvous address "
                    "(torchrun or course_lib.runtime.launch sets it)")
        if not 0 < _env_int("MASTER_PORT") < 65536:
            raise LaunchEnvironmentError(f"environment variable MASTER_PORT must be a port number (1-65535), got "
                                         f"{os.environ['MASTER_PORT']!r}")
        os.environ.update(gloo_on_loopback(os.environ["MASTER_ADDR"]))  # torchrun --standalone on a laptop
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    return get_dist_info()


def cleanup() -> None:
    """End every rank the same way: a barrier, then destroy the group (avoids aborts at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if get_dist_info().rank == 0:
        print(*args, **kwargs)


def setup_rank_logging(log_dir: str | os.PathLike = "logs", level: int = logging.INFO,
                       stream=None, console: bool = True) -> logging.Logger:
    """Log to <log_dir>/rank_<r>/train.log (and, if console, to `stream`, default stderr), tagged with the rank."""
    info = get_dist_info()
    path = Path(log_dir) / f"rank_{info.rank}" / "train.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("course")
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(LOG_FORMAT.format(rank=info.rank, world_size=info.world_size))
    handlers = [logging.FileHandler(path, mode="a")]
    if console:
        handlers.append(logging.StreamHandler(stream or sys.stderr))
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger

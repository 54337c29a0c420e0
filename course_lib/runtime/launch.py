"""Start N real torch.distributed ranks from Python — a notebook cell or a test — and get their results.

    from course_lib.runtime.launch import launch
    from course_lib.runtime import demo_workers
    results = launch(demo_workers.allreduce_demo, world_size=4)   # one entry per rank, in rank order

Each rank is a new process that imports the worker by its module path, as torchrun's ranks do: a function defined
in a notebook cell cannot be sent (it lives only in the notebook's memory). Put workers in course_lib or in a .py
file next to the notebook. On Linux the ranks come from a fork server, a helper process that has imported torch
and nothing else and forks each rank in milliseconds; elsewhere (macOS) each rank is a fresh interpreter (spawn).
Both are safe for CUDA; see START_METHOD_VARIABLE.

What this adds over torch.multiprocessing.spawn:
- the rendezvous store runs in the caller on a port the OS picks, so concurrent launches never collide;
- when a rank raises or dies, every rank is stopped within a second or two and the error names the rank that
  failed first, with its traceback (spawn reports whichever rank it happens to look at);
- every collective has a timeout (default 60 s): when it expires, the error says where every rank was (the
  collective it waited in and the line that called it, or the line a still-running rank was at, read from its
  Python stack, which faulthandler dumps on a signal) instead of a 30-minute silent hang;
- each rank's output goes to logs/rank_<r>/train.log and is echoed here with a [rank r] prefix.
"""

from __future__ import annotations

import faulthandler
import importlib
import linecache
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from multiprocessing import connection, get_context
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.core.checks import positive_int
from course_lib.nbtools import relative_paths
from course_lib.runtime.device_guard import guard_collectives
from course_lib.runtime.env import (DEFAULT_TIMEOUT_S, get_dist_info, gloo_on_loopback, init_distributed,
                                    setup_rank_logging)

STOP_GRACE_S = 1.0  # time the other ranks get to report their own errors before they are killed


class RankFailure(RuntimeError):
    """A rank raised, died or hung; `rank` is the one that failed first (or did not arrive)."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None, remote_traceback: str = "",
                 places: dict[int, str] | None = None, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.rank, self.exitcode, self.remote_traceback = rank, exitcode, remote_traceback
        self.places = places or {}  # rank -> where it was when a collective timed out (one line)
        self.stacks = stacks or {}  # rank -> its Python stack then (a traceback or a faulthandler dump)
        self.pids: list[int] = []  # the ranks' process ids (all stopped by the time this is raised)


# ----------------------------------------------------------------------------------------------- child side
class _LineSender:
    """sys.stdout/sys.stderr replacement in a rank: writes to its log file and sends lines to the caller."""

    def __init__(self, conn, lock, log_file, echo: bool):
        self.conn, self.lock, self.log_file, self.echo, self.buffer = conn, lock, log_file, echo, ""

    def write(self, text: str) -> int:
        self.log_file.write(text)
        self.log_file.flush()
        if self.echo:
            self.buffer += text
            *lines, self.buffer = self.buffer.split("\n")
            for line in lines:
                with self.lock:
                    self.conn.send(("log", line))
        return len(text)

    def flush(self) -> None:
        self.log_file.flush()

    def isatty(self) -> bool:
        return False


def _exit_with_parent(parent_pid: int) -> None:
    """A rank must not outlive its caller (a restarted kernel, a killed test run). A rank started by the fork
    server is the server's child, not the caller's: it watches the caller by its process id."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    direct = os.getppid() == parent_pid

    def alive() -> bool:
        if direct:
            return os.getppid() == parent_pid
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch():
        while alive():
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _rank_main(rank, world_size, addr, port, worker, args, kwargs, conn, options):
    if port is None:  # forked before the store existed: the caller sends its port
        port = conn.recv()[1]
    if options.get("environ") is not None:  # started by the fork server: the caller's environment, as it is now
        os.environ.clear()
        os.environ.update(options["environ"])
    # Set here, not inherited: two launches from two threads of one caller must not see each other's values.
    os.environ.update({key: str(value) for key, value in dict(
        RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size, MASTER_ADDR=addr,
        MASTER_PORT=port, OMP_NUM_THREADS=options["threads"]).items()})
    os.environ.update(options["env"])  # e.g. TORCH_DISTRIBUTED_DEBUG: read when the process group is created
    os.setpgrp()  # own process group: stopping this rank also stops anything it started
    _exit_with_parent(options["parent_pid"])
    log_path = Path(options["log_dir"]) / f"rank_{rank}" / "train.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w", buffering=1)  # one launch, one log
    os.dup2(log_file.fileno(), 1)  # C++ output (gloo, NCCL warnings) lands in the rank's log too
    os.dup2(log_file.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log_file, all_threads=True)  # the caller can ask "where are you?"
    faulthandler.enable(file=log_file, all_threads=True)  # a rank that aborts (gloo, a segfault) leaves its stack
    lock = threading.Lock()
    sys.stdout = sys.stderr = _LineSender(conn, lock, log_file, options["echo"])
    phase = "init"
    try:
        torch.set_num_threads(options["threads"])
        store = dist.TCPStore(addr, port, world_size, is_master=False,
                              timeout=timedelta(seconds=options["timeout_s"]))
        init_distributed(options["backend"], options["device"], options["timeout_s"], store=store)
        setup_rank_logging(options["log_dir"], stream=sys.stderr)
        if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            _skip_ddp_construction_log()
        phase = "worker"
        guard = os.environ.get(DEVICE_GUARD_VARIABLE) == "1"
        with rank_context(rank), guard_collectives(get_dist_info().device) if guard else nullcontext():
            result = worker(*args, **kwargs)
        phase = "result"
        payload = pickle.dumps(result)
    except BaseException as exc:  # report, then leave at once: peers may be stuck in a collective with us
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        report = ("error", phase, f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time(), frames)
        with lock:
            conn.send(report)
        log_file.write(report[3])
        log_file.flush()
        os._exit(1)
    with lock:
        conn.send(("result", payload))
    if conn.recv() == "release":  # every rank finished its worker: now the final barrier cannot mismatch
        dist.barrier()
        dist.destroy_process_group()
    log_file.flush()
    os._exit(0)


def _skip_ddp_construction_log() -> None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, torch 2.13's CPU build crashes (SIGSEGV) in the usage statistics that
    DistributedDataParallel logs when it is constructed; DETAIL's checks of every collective are unaffected."""
    logger = getattr(dist, "Logger", None)
    if logger is not None:
        logger.set_construction_data_and_log = lambda self, *args, **kwargs: None


# ---------------------------------------------------------------------------------------------- caller side
_ENVIRONMENT_LOCK = threading.Lock()


@contextmanager
def _environment(values: dict):
    """Temporarily set variables that a new interpreter must see before it imports torch (thread counts)."""
    with _ENVIRONMENT_LOCK:
        yield from _patched_environment(values)


def _patched_environment(values: dict):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({key: str(value) for key, value in values.items()})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _check_spawnable(worker) -> None:
    module = getattr(worker, "__module__", None)
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"worker {getattr(worker, '__qualname__', worker)!r} is defined in this notebook/interactive session. "
            "Spawned ranks are new interpreters that import the worker by module path, so it must live in a "
            "module: use one from course_lib, put it in a .py file next to the notebook and import it, or wrap it "
            "with course_lib.runtime.spawn.spawnable (which saves a self-contained function to a module)."
        )
    try:
        pickle.dumps(worker)
    except Exception as exc:
        raise TypeError(f"worker {worker!r} cannot be sent to the ranks (pickle failed: {exc})") from exc


def _is_collateral(message: str) -> bool:
    """Errors a rank gets because a *peer* failed (its socket closed under a collective)."""
    lowered = message.lower()
    return any(s in lowered for s in ("connection closed", "connection reset", "broken pipe", "peer"))


def _is_timeout(message: str) -> bool:
    return "timed out" in message.lower() or "timeout" in message.lower()


def _signal_name(exitcode: int) -> str:
    try:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"exited with code {exitcode}"


def _log_tail(log_dir, rank: int, lines: int = 15) -> str:
    """The last lines of a rank's log; for a rank that died of a signal, the lines before faulthandler's report
    (what the process printed last, such as a C++ library's error) and the stack of its main thread."""
    path = Path(log_dir) / f"rank_{rank}" / "train.log"
    if not path.exists():
        return ""
    text = path.read_text(errors="replace")
    before, marker, report = text.partition("Fatal Python error")
    if not marker:
        return "\n".join(text.splitlines()[-lines:])
    error = report.splitlines()[0] if report else ""
    stack = _main_thread(report.split("\n", 1)[-1].split("\nExtension modules:")[0])
    return "\n".join([*before.splitlines()[-lines:], f"Fatal Python error{error}", stack])


_LAUNCHER_FILE = os.path.abspath(__file__)
NOT_THE_WORKERS_CODE: set[str] = set()
"""Files whose frames `where` skips like torch's own: instrumentation around the worker's calls (counters)."""
_LIBRARY_FOLDERS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))),  # site-packages
                          os.path.dirname(os.path.abspath(os.__file__))})  # the standard library


def _is_own_code(filename: str) -> bool:
    """A frame of the code the ranks run (the worker and what it calls), not of torch, Python or this launcher."""
    path = os.path.abspath(filename)
    installed = path.startswith(_LIBRARY_FOLDERS) or any(f"{os.sep}{d}{os.sep}" in path
                                                         for d in ("site-packages", "dist-packages"))
    internal = filename.startswith(("<frozen", "<string>")) or path in NOT_THE_WORKERS_CODE
    return path != _LAUNCHER_FILE and not installed and not internal


def where(frames) -> str:
    """One line saying where a stack stands: "in all_reduce, called at job.py:42 in evaluate: dist.all_reduce(x),
    from job.py:90 in train: loss = evaluate(model)" (the innermost frame and up to two of its callers).

    frames: (filename, line number, function) from the outermost call to the innermost. The collective is the
    innermost torch.distributed function on the stack; the place is the innermost frame of the ranks' own code.
    """
    frames = list(frames)
    collective = next((name for filename, _, name in reversed(frames)
                       if filename.endswith("distributed_c10d.py") and not name.startswith("_")), None)
    if collective is None:  # DistributedDataParallel's own communication (bucket rebuild, buffers) is C++
        collective = next((f"DistributedDataParallel ({name})" for filename, _, name in reversed(frames)
                           if filename.endswith(os.path.join("nn", "parallel", "distributed.py"))), None)
    own = [frame for frame in frames if _is_own_code(frame[0])]
    if not own:
        return f"in {collective}" if collective else "(no frame of the worker's code on its stack)"
    places = []
    for filename, line, function in reversed(own[-3:]):  # the innermost frame, then up to two of its callers
        code = linecache.getline(filename, line).strip()
        places.append(f"{relative_paths(filename)}:{line} in {function}" + (f": {code}" if code else ""))
    place = ", from ".join(places)
    return f"in {collective}, called at {place}" if collective else f"at {place}"


def _main_thread(dump: str) -> str:
    """The block of a faulthandler dump (all threads) that shows the rank's main thread, the one running the worker."""
    blocks = re.split(r"\n\s*(?=(?:Current thread|Thread) 0x)", dump.strip())
    return next((block for block in blocks if "in _rank_main" in block), blocks[-1])


def frames_of_dump(dump: str) -> list[tuple[str, int, str]]:
    """The main thread's frames, outermost first, from a faulthandler dump (which lists the innermost first)."""
    frames = [(m.group(1), int(m.group(2)), m.group(3))
              for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', _main_thread(dump))]
    return frames[::-1]


def _stack_of(proc, log_dir, rank: int) -> str:
    """Ask a live rank for its Python stack (faulthandler on SIGUSR1) and read it from its log."""
    path = Path(log_dir) / f"rank_{rank}" / "train.log"
    start = path.stat().st_size if path.exists() else 0
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(process already gone)"
    time.sleep(0.5)
    with open(path, errors="replace") as f:
        f.seek(start)
        return f.read().strip() or "(no stack reported)"


def _stop_all(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in procs:
        proc.join(timeout=5)


START_METHODS = ("forkserver", "spawn", "fork")
START_METHOD_VARIABLE = "COURSE_LAUNCH_START_METHOD"
"""How ranks start. Unset: "forkserver" on Linux, "spawn" elsewhere (macOS: a process that has loaded Apple's
frameworks, as importing torch does, must not fork). The fork server is one process per caller that imports torch
once and, having run nothing, forks a rank in milliseconds; each rank then imports the worker's module afresh and
sets the caller's environment, so it behaves as a spawned rank does, without importing torch again.
"spawn": a fresh interpreter per rank. Set to "fork" by a process that launches many short jobs from a parent that has already imported torch and
runs no thread of its own, no thread pool and no CUDA (the grading sandbox's checks): each rank then starts in
milliseconds instead of importing torch again; the ranks are forked before the rendezvous store's thread starts.
Anything else should keep the default, "spawn". Where a forked child could not run backward, the ranks are
spawned anyway (_fork_keeps_autograd)."""
DEVICE_GUARD_VARIABLE = "COURSE_DEVICE_GUARD"
"""Set to 1: every rank checks that the tensors it hands to collectives are on its device (device_guard)."""

RANK_CONTEXT_VARIABLE = "COURSE_RANK_CONTEXT"
"""'package.module:function': every rank runs its worker inside function(rank), a context manager (the grading
sandbox names its integrity check here: course_tools.grading.integrity.graded_rank). Unset: nothing."""


def rank_context(rank: int):
    """The context RANK_CONTEXT_VARIABLE names for this rank, or one that does nothing."""
    spec = os.environ.get(RANK_CONTEXT_VARIABLE, "")
    if not spec:
        return nullcontext()
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{RANK_CONTEXT_VARIABLE}={spec!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), name)(rank)


def _fork_keeps_autograd() -> bool:
    """Whether a child forked from this process now can still run a backward pass.

    Once autograd has started threads of its own in a process (FSDP2's backward does so in torch 2.11's CUDA
    build, even on a machine without a GPU), every child forked from it raises "Unable to handle autograd's
    threading in combination with fork-based multiprocessing" at its first backward. A throwaway child tries the
    backward of one number and exits with 0 if it ran.
    """
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            x = torch.ones(1, requires_grad=True)
            (2 * x).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


FORKSERVER_PRELOAD = ["torch", "torch.distributed"]


def _start_method() -> str:
    method = os.environ.get(START_METHOD_VARIABLE) or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_VARIABLE}={method!r}: choose one of {', '.join(START_METHODS)}")
    if method == "fork" and not _fork_keeps_autograd():
        return "spawn"
    return method


def launch(worker, world_size: int, args: tuple = (), kwargs: dict | None = None, *, backend: str | None = None,
           device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S, log_dir: str | os.PathLike | None = None,
           threads_per_rank: int | None = None, echo: bool = True, master_addr: str = "127.0.0.1",
           env: dict[str, str] | None = None) -> list:
    """Run `worker(*args, **kwargs)` on `world_size` ranks; return the list of their return values.

    backend: None picks gloo on CPU, "cpu:gloo,cuda:nccl" on CUDA (env.CUDA_BACKEND). device: 'cpu', 'cuda' or 'auto'.
    timeout_s: collective timeout and hang watchdog. threads_per_rank: default cores // world_size (>= 1).
    env: environment variables every rank sets before it joins the process group, such as
    {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} (torch then checks that all ranks call the same collective with the same
    shapes, and reports the first mismatch instead of hanging).
    log_dir: where rank r writes <log_dir>/rank_<r>/train.log. None: a folder of this launch's own,
    logs/launches/<time>-<pid>-<n>/, so that launches running at the same time never mix their logs; when it
    ends, each rank's log is also copied to logs/rank_<r>/train.log (the latest launch's, all ranks from the same
    launch). A log_dir that another launch is writing at the same moment is not shared: this launch writes to
    <log_dir>/concurrent/<time>-<pid>-<n>/ and says so.
    Raises RankFailure naming the rank that failed first.

    In a script, call it under `if __name__ == "__main__":`: spawned ranks import the script again.
    """
    positive_int("world_size", world_size)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    _check_spawnable(worker)
    kwargs = kwargs or {}
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    # torch reads TORCH_DISTRIBUTED_DEBUG once per process, so a forked rank would keep its parent's level
    method = "spawn" if env and "TORCH_DISTRIBUTED_DEBUG" in env else _start_method()
    ctx = get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)

    def host_store():  # the caller hosts the rendezvous store on a port the OS picks: no race for a "free" port
        return dist.TCPStore(master_addr, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    # Forked ranks must be forked before the store's server thread exists (a lock it holds would stay locked
    # in the child forever): they are started first and receive the port through their pipe.
    store = host_store() if method != "fork" else None
    latest, claim = None, None
    if log_dir is None:
        latest = Path(DEFAULT_LOG_DIR)
        log_dir = _launch_log_dir(latest)
    else:
        log_dir, claim = _claim_log_dir(Path(log_dir))
    env = {**gloo_on_loopback(master_addr), **(env or {})}  # all ranks on this machine: gloo on the loopback
    options = dict(backend=backend, device=device, timeout_s=timeout_s, log_dir=str(log_dir), threads=threads,
                   echo=echo, parent_pid=os.getpid(), env={str(k): str(v) for k, v in env.items()},
                   environ=None)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            with _environment({"OMP_NUM_THREADS": threads, **options["env"]}):  # seen as the interpreter starts
                if method == "forkserver":  # the server's environment is the one it started with: send ours
                    options["environ"] = dict(os.environ)
                proc = ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=False,
                                   args=(rank, world_size, master_addr, store.port if store else None, worker, args,
                                         kwargs, child_conn, options))
                proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        if store is None:
            store = host_store()
            for conn in conns:
                conn.send(("port", store.port))
        return _supervise(procs, conns, log_dir, timeout_s)
    except RankFailure as failure:
        failure.pids = [proc.pid for proc in procs]
        raise
    finally:
        _stop_all(procs)
        for conn in conns:
            conn.close()
        del store
        if claim is not None:
            claim.close()  # releases the folder for the next launch
        if latest is not None:
            _publish_latest(log_dir, latest, world_size)


DEFAULT_LOG_DIR = "logs"
_LAUNCHES = iter(range(1, 1 << 30))


def _launch_log_dir(root: Path) -> Path:
    """logs/launches/<time>-<pid>-<n>: one folder per launch, whoever else launches at the same time."""
    return root / "launches" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_LAUNCHES)}"


def _locked(path: Path, blocking: bool):
    """An open file holding an exclusive lock on `path` (fcntl.flock: released on close, or when the process
    dies, so no lock outlives its launch), or None when another holder has it and blocking is False."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a")
    try:
        import fcntl  # POSIX: Linux and macOS
    except ImportError:  # pragma: no cover - Windows has no flock; launches there share folders as before
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _claim_log_dir(log_dir: Path) -> tuple[Path, object]:
    """(the folder this launch writes its rank logs to, the lock to close when it ends): log_dir itself, or, while
    another launch is writing there, a folder of this launch's own inside it (never two launches in one file)."""
    claim = _locked(log_dir / ".launch.lock", blocking=False)
    if claim is not None:
        return log_dir, claim
    own = _launch_log_dir(log_dir / "concurrent")
    print(f"note: another launch is writing its logs to {relative_paths(str(log_dir))} now; this launch's rank logs "
          f"go to {relative_paths(str(own))}", flush=True)
    return own, _locked(own / ".launch.lock", blocking=True)


def _publish_latest(log_dir, latest: Path, world_size: int) -> None:
    """Copy each rank's log of this launch to logs/rank_<r>/train.log, all of them under one lock, so that the
    copies all come from one launch (the latest to end), and remove copies of ranks this launch did not have."""
    lock = _locked(latest / ".latest.lock", blocking=True)
    try:
        for rank in range(world_size):
            source = Path(log_dir) / f"rank_{rank}" / "train.log"
            if source.is_file():
                target = latest / f"rank_{rank}" / "train.log"
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".train.log.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(source.read_bytes())
                os.replace(tmp, target)
        for extra in latest.glob("rank_*/train.log"):  # a copy of an earlier, larger launch (kept in launches/)
            if extra.parent.name[len("rank_"):].isdigit() and int(extra.parent.name[len("rank_"):]) >= world_size:
                extra.unlink()
        (latest / "latest_launch.txt").write_text(f"{Path(log_dir).name}\n")
    finally:
        lock.close()


def run_each(calls):
    """Worker: several workers in turn on the same ranks, for one start-up (starting ranks and importing torch
    take seconds; a check often takes less). calls: {name: (worker, kwargs)} -> {name: result}, or a list of
    (worker, kwargs) -> the list of results. Every rank waits at a barrier after each worker.

        ranks = launch(run_each, 2, args=({"naive": (data_parallel_run, dict(strategy="naive")),
                                           "bucketed": (data_parallel_run, dict(strategy="bucketed"))},))
    """
    def run(worker, kwargs):
        result = worker(**kwargs)
        dist.barrier()
        return result
    if isinstance(calls, dict):
        return {name: run(worker, kwargs) for name, (worker, kwargs) in calls.items()}
    return [run(worker, kwargs) for worker, kwargs in calls]


def _supervise(procs, conns, log_dir, timeout_s) -> list:
    world_size = len(procs)
    results, errors, deaths = {}, {}, {}
    first_done_at = None
    open_conns = dict(enumerate(conns))

    def drain(rank, conn):
        try:
            while conn.poll():
                message = conn.recv()
                if message[0] == "log":
                    print(f"[rank {rank}] {message[1]}", flush=True)
                elif message[0] == "result":
                    results[rank] = pickle.loads(message[1])
                else:
                    errors[rank] = message[1:]
        except (EOFError, OSError):
            open_conns.pop(rank, None)

    while len(results) < world_size:
        sentinels = {procs[r].sentinel: r for r in range(world_size) if r not in results}
        ready = connection.wait(list(open_conns.values()) + list(sentinels), timeout=0.5)
        for rank, conn in list(open_conns.items()):
            if conn in ready:
                drain(rank, conn)
        for handle in ready:
            rank = sentinels.get(handle)
            if rank is not None and rank in open_conns:
                drain(rank, open_conns[rank])
            if rank is not None and rank not in results and rank not in errors:
                procs[rank].join(timeout=1)
                deaths[rank] = procs[rank].exitcode
        if results and first_done_at is None:
            first_done_at = time.monotonic()
        hung = first_done_at is not None and time.monotonic() - first_done_at > timeout_s + STOP_GRACE_S
        if errors or deaths or hung:
            _fail(procs, open_conns, drain, results, errors, deaths, log_dir, timeout_s)
    for conn in conns:
        conn.send("release")
    for proc in procs:
        proc.join(timeout=10)
    return [results[rank] for rank in range(world_size)]


def _fail(procs, open_conns, drain, results, errors, deaths, log_dir, timeout_s):
    # Give the other ranks a moment to report what they saw, then decide who failed first.
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        for rank, conn in list(open_conns.items()):
            drain(rank, conn)
        time.sleep(0.05)
    for rank, proc in enumerate(procs):
        if rank not in results and rank not in errors and not proc.is_alive():
            deaths.setdefault(rank, proc.exitcode)
    signalled = {r: code for r, code in deaths.items() if code is not None and code < 0}
    if signalled:  # a rank that was killed outright is the cause; its peers' socket errors are collateral
        rank = min(signalled)
        _stop_all(procs)
        raise RankFailure(f"rank {rank} died ({_signal_name(signalled[rank])}) without reporting an error; "
                          f"all {len(procs)} ranks were stopped.\n--- last lines of rank {rank}'s log ---\n"
                          f"{_log_tail(log_dir, rank)}", rank, signalled[rank])
    own = {r: e for r, e in errors.items() if not _is_collateral(e[1]) and not _is_timeout(e[1])}
    if own:
        rank = min(own, key=lambda r: own[r][3])  # earliest report
        phase, message, remote_tb = own[rank][:3]
        _stop_all(procs)
        raise RankFailure(f"rank {rank} failed in {phase}: {message}\nall {len(procs)} ranks were stopped.\n"
                          f"--- traceback of rank {rank} ---\n{remote_tb}", rank, 1, remote_tb)
    timed_out = any(_is_timeout(e[1]) for e in errors.values()) and all(
        _is_timeout(e[1]) or _is_collateral(e[1]) for e in errors.values())  # a peer's timeout closes sockets
    if timed_out or not errors and not deaths:
        waiting = sorted(errors)
        missing = [r for r in range(len(procs)) if r not in errors]
        places, stacks = {}, {}
        for rank in range(len(procs)):
            if rank in errors:
                places[rank] = f"waited {where(errors[rank][4])}"
                stacks[rank] = errors[rank][2]
            elif rank in results:
                places[rank] = "had already returned from the worker: it skipped a collective that the others called"
            else:
                dump = _stack_of(procs[rank], log_dir, rank)
                places[rank] = f"was still running, {where(frames_of_dump(dump))}"
                stacks[rank] = relative_paths(_main_thread(dump))
        _stop_all(procs)
        details = [f"rank {rank} {place}" for rank, place in places.items()]
        reporting = [rank for rank in waiting if _is_timeout(errors[rank][1])] or waiting
        if reporting:
            details.append(f"rank {reporting[0]} reported: {errors[reporting[0]][1]}")
        details += [f"--- stack of rank {rank}, still running ---\n{stacks[rank]}" for rank in missing if rank in stacks]
        if missing:
            head = f"rank(s) {', '.join(map(str, missing))} did not arrive while rank(s) {', '.join(map(str, waiting)) or 'none'} waited"
        else:
            head = f"rank(s) {', '.join(map(str, waiting))} waited"
        raise RankFailure(f"collective timed out after {timeout_s:g} s: {head}.\n" + "\n".join(details),
                          missing[0] if missing else waiting[0], places=places, stacks=stacks)
    rank = min(errors or deaths)
    message = errors[rank][1] if rank in errors else _signal_name(deaths[rank] or 0)
    remote_tb = errors[rank][2] if rank in errors else _log_tail(log_dir, rank)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if rank not in errors and not (Path(log_dir) / f"rank_{rank}" / "train.log").exists() and main_file:
        remote_tb += (f"\nrank {rank} ended before it started: if {main_file} calls launch() at its top level, put "
                      "the call under `if __name__ == \"__main__\":` (each spawned rank imports the script again, "
                      "and would launch again)")
    _stop_all(procs)
    raise RankFailure(f"rank {rank} failed: {message}\nall {len(procs)} ranks were stopped.\n{remote_tb}",
                      rank, deaths.get(rank), remote_tb)

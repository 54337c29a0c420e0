"""Run a debugging-lab job on real ranks and keep everything it leaves behind, as a cluster job would.

    from course_lib.debugging import run_job
    run = run_job("job_01", out_dir="runs/session_c/06_debugging_lab")
    run.show()                     # what the launcher reported and the last lines of every rank's log
    print(run.log(1))              # rank 1's whole log
    run.steps("params")            # a table: one row per step, one column per rank (here: parameter checksums)
    run.collectives                # per rank: how many times each collective ran

Each run gets a folder of its own, <out_dir>/<job>/run_<n> (earlier runs are kept): the script the ranks ran
(train_job.py: tracebacks point into it), logs/rank_<r>/train.log, and the job's checkpoints under out/.

`fixes` replaces functions (or classes) of the script by ones written in a notebook cell: each is compiled
into the script's module on every rank, under its own name, before the job starts. The script's own imports
and functions are there for it, as they are for the lines it replaces.

`debug="DETAIL"` sets TORCH_DISTRIBUTED_DEBUG=DETAIL on every rank: torch then compares, before each
collective, what every rank is about to call (its "fingerprint": operation, shapes, dtypes) and raises on the
first mismatch instead of hanging.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import linecache
import os
import re
import sys
import tempfile
import textwrap
import time
from collections import Counter
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from course_lib.debugging import train_job
from course_lib.debugging.jobs import JOBS, script_of
from course_lib.nbtools import relative_paths, shown
from course_lib.runtime.launch import NOT_THE_WORKERS_CODE, RankFailure, launch
from course_lib.runtime.spawn import single_process_group

COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
           "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
           "gather_object", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")
"""torch.distributed functions counted on every rank (calls made through `dist.<name>`)."""
DDP_BUCKETS = "DDP gradient bucket all_reduce"
"""The name under which a run counts DistributedDataParallel's all-reduces of gradient buckets."""


NOT_THE_WORKERS_CODE.add(os.path.abspath(__file__))  # where a rank waits is in the job, not in the counters


# ------------------------------------------------------------------------------------------ on every rank
@contextmanager
def counting_collectives(counts: Counter):
    """Count the collectives this rank calls: torch.distributed's functions, and DDP's gradient all-reduces (a
    communication hook that counts each bucket, then all-reduces it as DDP does by default)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}

    def counted(name, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        call.__wrapped__ = function
        return call

    def counting_hook(process_group, bucket):
        counts[DDP_BUCKETS] += 1
        return allreduce_hook(process_group, bucket)

    init = DistributedDataParallel.__init__

    def init_with_hook(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, counting_hook)

    for name, function in originals.items():
        setattr(dist, name, counted(name, function))
    DistributedDataParallel.__init__ = init_with_hook
    try:
        yield counts
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        DistributedDataParallel.__init__ = init


def import_script(path: str, name: str):
    """The module of a script file, imported under `name` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    spec.loader.exec_module(module)
    return module


def job_rank(script: str, config: dict, fixes: list[tuple[str, str]], first_config: dict | None = None) -> dict:
    """Worker: import the job's script, compile the fixes into it, run train(JobConfig(**config)) and return its
    result with this rank's collective counts. first_config: run the job once with it before (a first attempt
    that left a checkpoint behind)."""
    module = import_script(script, f"course_debugging_job_{os.getpid()}")
    for label, source in fixes:
        linecache.cache[label] = (len(source), None, source.splitlines(keepends=True), label)
        exec(compile(source, label, "exec"), module.__dict__)
    if first_config is not None:
        module.train(module.JobConfig(**first_config))
        dist.barrier()
    counts = Counter()
    with counting_collectives(counts):
        result = module.train(module.JobConfig(**config))
    result["collectives"] = dict(counts)
    return result


# ------------------------------------------------------------------------------------------ in the notebook
def fix_sources(fixes) -> list[tuple[str, str]]:
    """(label, source) for each function or class of `fixes`, with the line numbers of the cell it is in."""
    sources = []
    for fix in fixes:
        if not (inspect.isfunction(fix) or inspect.isclass(fix)):
            raise TypeError(f"fixes holds functions and classes written to replace the script's, got {fix!r}")
        try:
            lines, first = inspect.getsourcelines(fix) if inspect.isfunction(fix) else _class_lines(fix)
        except (OSError, TypeError) as err:
            raise ValueError(f"cannot read the source of {fix.__name__} ({err}): define it in a notebook cell") from None
        source = "\n" * (max(first, 1) - 1) + textwrap.dedent("".join(lines))
        sources.append((f"<your {fix.__name__}>", source))
    return sources


def _class_lines(cls) -> tuple[list[str], int]:
    """A class's source lines and first line number, found through its methods' code (inspect.getsource cannot
    find a class defined in a notebook cell: it looks for the class in its module's file)."""
    methods = [value for value in vars(cls).values() if inspect.isfunction(value)]
    if not methods:
        raise OSError("a class without methods of its own")
    code = methods[0].__code__
    lines = linecache.getlines(code.co_filename)
    header = re.compile(rf"^(\s*)class\s+{re.escape(cls.__name__)}\b")
    start = next((i for i in range(code.co_firstlineno - 1, -1, -1) if header.match(lines[i])), None)
    if start is None:
        raise OSError(f"no `class {cls.__name__}` line above its methods in {code.co_filename}")
    indent = len(header.match(lines[start]).group(1))
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    while start > 0 and lines[start - 1].lstrip().startswith("@"):  # decorators belong to the class
        start -= 1
    return lines[start:end], start + 1


@dataclass
class JobRun:
    """What one run of a job left behind."""

    job: str
    world_size: int
    folder: Path
    results: list | None = None           # one train() result per rank, when every rank finished
    failure: RankFailure | None = None    # what the launcher reported, when a rank failed or hung
    seconds: float = 0.0
    collectives: list[dict] = field(default_factory=list)  # per rank: {collective: calls}
    settings: dict = field(default_factory=dict)  # the JobConfig fields it ran with
    fixes: list = field(default_factory=list)  # (label, source) of the functions that replaced the script's

    @property
    def ok(self) -> bool:
        return self.failure is None

    def script(self):
        """The job's script imported in this process (no ranks), with the run's fixes compiled in: its functions
        and JobConfig, to try things out."""
        module = import_script(str(self.folder / "train_job.py"), f"course_debugging_{self.job}_{self.folder.name}")
        for label, source in self.fixes:
            exec(compile(source, label, "exec"), module.__dict__)
        return module

    def config(self):
        """The JobConfig the job ran with."""
        module = self.script()
        return module.JobConfig(**self.settings)

    def log(self, rank: int) -> str:
        path = self.folder / "logs" / f"rank_{rank}" / "train.log"
        return relative_paths(path.read_text(errors="replace")) if path.exists() else ""

    def steps(self, key: str = "params") -> list[tuple]:
        """(step, value of rank 0, value of rank 1, ...) for every step that every rank logged."""
        if not self.results:
            return []
        per_rank = [{record["step"]: record.get(key) for record in r["history"]} for r in self.results]
        common = sorted(set.intersection(*(set(steps) for steps in per_rank)))
        return [(step, *(steps[step] for steps in per_rank)) for step in common]

    def show(self, log_lines: int = 6) -> None:
        """Print what a learner sees after a job: how it ended, then the last lines of every rank's log."""
        where = shown(self.folder)
        if self.failure is None:
            print(f"{self.job}: {self.world_size} ranks finished in {self.seconds:.1f} s ({where})")
        else:
            print(f"{self.job}: FAILED after {self.seconds:.1f} s ({where})")
            print(relative_paths(str(self.failure)))
        for rank in range(self.world_size):
            lines = self.log(rank).rstrip().splitlines()
            print(f"--- {where}/logs/rank_{rank}/train.log, last {min(log_lines, len(lines))} of {len(lines)} lines ---")
            print("\n".join(lines[-log_lines:]))


def new_run_folder(out_dir, job: str) -> Path:
    """<out_dir>/<job>/run_<n>, n one more than the last run's: a rerun never touches an earlier run."""
    parent = Path(out_dir) / job
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[4:]) for p in parent.glob("run_*") if p.name[4:].isdigit()]
    for n in range(max(taken, default=0) + 1, max(taken, default=0) + 1000):
        try:
            (parent / f"run_{n}").mkdir()
            return parent / f"run_{n}"
        except FileExistsError:  # another run took it first
            continue
    raise RuntimeError(f"no free run folder under {parent}")


def run_job(job: str, world_size: int | None = None, *, out_dir="runs/debugging", fixes=(), config: dict | None = None,
            debug: str | None = None, timeout_s: float = 10.0, first_run: bool = True) -> JobRun:
    """Run job `job` ("base" for train_job.py itself) on `world_size` ranks (default: the job's own) and return
    what it left behind; never raises for a failing job (run.failure says what happened).

    fixes: functions or classes that replace the script's own (see the module docstring). config: JobConfig
    fields on top of the job's. debug: None, "INFO" or "DETAIL" (TORCH_DISTRIBUTED_DEBUG). first_run: for a
    job that resumes, run it once without resuming first, so that there is a checkpoint to resume from.
    """
    spec = JOBS.get(job) if job != "base" else None
    if job != "base" and spec is None:
        raise KeyError(f"no job named {job!r}: the lab's jobs are base, {', '.join(JOBS)}")
    if debug not in (None, "OFF", "INFO", "DETAIL"):
        raise ValueError(f"debug must be None, 'INFO' or 'DETAIL' (TORCH_DISTRIBUTED_DEBUG), got {debug!r}")
    world_size = world_size or (spec.world_size if spec else 2)
    folder = new_run_folder(out_dir, job)
    script = folder / "train_job.py"
    script.write_text(script_of(job) if spec else inspect.getsource(train_job))
    settings = {**(spec.config if spec else {}), **(config or {}), "out_dir": str(folder / "out")}
    first = {**settings, "resume": False} if settings.get("resume") and first_run else None
    run = JobRun(job, world_size, folder, settings=settings, fixes=fix_sources(fixes))
    start = time.perf_counter()
    try:
        run.results = launch(job_rank, world_size, args=(str(script), settings, run.fixes, first),
                             log_dir=folder / "logs", echo=False, timeout_s=timeout_s, threads_per_rank=1,
                             env={"TORCH_DISTRIBUTED_DEBUG": debug} if debug else None)
        run.collectives = [r.pop("collectives") for r in run.results]
    except RankFailure as failure:
        run.failure = failure
    run.seconds = time.perf_counter() - start
    return run


def one_process(job: str = "base", world_size: int = 2, config: dict | None = None, out_dir=None) -> dict:
    """train_job.py (the job without its bug) in this process, on one rank, with the global batch of
    `world_size` ranks (micro_batch x world_size rows per micro-batch): what `world_size` ranks must compute, and
    the collectives they must run (result["collectives"])."""
    spec = JOBS.get(job)
    settings = {**(spec.config if spec else {}), **(config or {})}
    settings["micro_batch"] = settings.get("micro_batch", train_job.JobConfig.micro_batch) * world_size
    with tempfile.TemporaryDirectory(prefix="one-process-") as scratch, single_process_group(), \
            redirect_stdout(io.StringIO()):  # its log lines are not the lesson
        settings["out_dir"] = str(Path(out_dir or scratch) / "out")
        if settings.get("resume"):
            train_job.train(train_job.JobConfig(**{**settings, "resume": False}))
        counts = Counter()
        with counting_collectives(counts):  # a correct job runs as many of each collective on any number of ranks
            result = train_job.train(train_job.JobConfig(**settings))
        result["collectives"] = dict(counts)
        return result

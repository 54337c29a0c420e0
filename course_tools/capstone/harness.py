"""The capstone's checks: a learner's own training script, run under torchrun as a cluster would run it.

    python -m course_tools.capstone scripts/ddp_simulation_train.py -- \\
        --max_steps {steps} --batch_size {rows_per_rank} --out_dir {out_dir} --log_dir {log_dir} \\
        --resume-flag=--resume

The script gets its arguments from the template after `--`, with {steps}, {out_dir}, {log_dir}, {rows_per_rank},
{global_batch} and {ranks} filled in for each run. The harness starts four runs, each with torchrun and the probe
(course_tools/capstone/probe.py), which observes without changing the script:

1. 2 ranks, {steps} steps. Checks: every rank exits 0; every rank writes its own log file under {log_dir} (a
   path naming its rank: rank_1/, rank1.log, ...); a shuffling DistributedSampler gets set_epoch before every
   epoch; no rank but 0 writes a checkpoint (torch.distributed.checkpoint's sharded saves are fine).
2. 1 rank, the same global batch: the loss of every step equals the 2-rank run's (mean over the ranks), to
   rtol 1e-4: the data is split, not repeated, and the gradients are averaged.
3. 2 ranks, stopped by SIGTERM after step {stop_at}, sent to torchrun as a scheduler does: every rank must
   exit through Python (not killed by the signal) within the grace period, with exit code 0, after
   checkpointing; no rank may be left waiting in a collective for one that stopped.
4. 2 ranks with the resume flag: the run continues from the checkpoint (it does fewer than {steps} steps, and
   no step the stopped run had finished is repeated), and its losses equal run 1's for the same steps.

Every failure is reported with what was seen and what to change; the output of each rank is kept in the work
folder (--work) for reading.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.runtime.env import gloo_on_loopback
from course_tools.capstone.probe import REPORT_DIR, STOP_AT_STEP

PLACEHOLDERS = ("steps", "out_dir", "log_dir", "rows_per_rank", "global_batch", "ranks")
RTOL = 1e-4


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Run:
    """One torchrun launch: exit code, each rank's probe report (None: the rank wrote none), where its output is."""

    name: str
    ranks: int
    returncode: int | None
    reports: dict[int, dict | None]
    out_dir: Path
    log_dir: Path
    console: Path
    seconds: float

    def losses(self) -> list[float | None]:
        """Per step, the mean over the ranks of each rank's loss (None where a rank recorded none)."""
        per_rank = [r["losses"] for r in self.reports.values() if r]
        steps = min((len(x) for x in per_rank), default=0)
        out = []
        for i in range(steps):
            values = [x[i] for x in per_rank]
            out.append(None if None in values else sum(values) / len(values))
        return out

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.console.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("      " + line for line in text[-lines:])


@dataclass
class Result:
    script: str
    checks: list[Check] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    def summary(self) -> str:
        lines = [f"capstone checks of {self.script}"]
        for c in self.checks:
            lines.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
        lines.append("PASSED: every check holds" if self.passed else
                     f"FAILED: {sum(not c.ok for c in self.checks)} check(s) to fix (the first one first: later "
                     "runs were not started)" if any(not c.ok for c in self.checks) else "no check ran")
        return "\n".join(lines)


def fill(template: list[str], values: dict) -> list[str]:
    out = []
    for arg in template:
        try:
            out.append(arg.format(**values))
        except KeyError as err:
            raise ValueError(f"unknown placeholder {{{err.args[0]}}} in the script arguments {arg!r}: the harness "
                             f"fills {', '.join('{' + p + '}' for p in PLACEHOLDERS)}") from None
    return out


class Harness:
    def __init__(self, script, args: list[str], *, resume_args: list[str], steps: int = 8, stop_at: int = 3,
                 global_batch: int = 8, ranks: int = 2, work=None, timeout_s: float = 300.0,
                 grace_s: float = 60.0, python: str = sys.executable):
        self.script = Path(script)
        if not self.script.is_file():
            raise FileNotFoundError(f"the training script {self.script} does not exist")
        if ranks < 2:
            raise ValueError(f"ranks must be at least 2 to check a distributed script, got {ranks}")
        if global_batch % ranks:
            raise ValueError(f"global_batch={global_batch} does not split over {ranks} ranks")
        if not 0 < stop_at < steps:
            raise ValueError(f"stop_at={stop_at} must be a step inside the run (1..{steps - 1})")
        self.args, self.resume_args = list(args), list(resume_args)
        self.steps, self.stop_at, self.global_batch, self.ranks = steps, stop_at, global_batch, ranks
        self.work = Path(work) if work else Path(tempfile.mkdtemp(prefix="capstone-"))
        self.timeout_s, self.grace_s, self.python = timeout_s, grace_s, python
        fill(self.args, self._values(1, self.work, self.work))  # a bad placeholder fails now, not in a run

    def _values(self, ranks: int, out_dir: Path, log_dir: Path) -> dict:
        return {"steps": self.steps, "out_dir": str(out_dir), "log_dir": str(log_dir), "ranks": ranks,
                "rows_per_rank": self.global_batch // ranks, "global_batch": self.global_batch}

    def launch(self, name: str, ranks: int, *, run_dir: str | None = None, stop_at: int | None = None,
               resume: bool = False) -> Run:
        """torchrun --nproc_per_node=ranks -m course_tools.capstone.probe SCRIPT ARGS, in its own folders."""
        base = self.work / (run_dir or name)
        out_dir, log_dir, reports = base / "out", base / "logs", self.work / name / "reports"
        shutil.rmtree(reports, ignore_errors=True)
        reports.mkdir(parents=True)
        args = fill(self.args, self._values(ranks, out_dir, log_dir)) + (self.resume_args if resume else [])
        command = [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   "--max_restarts", "0", "-m", "course_tools.capstone.probe", str(self.script.resolve()), *args]
        env = {**os.environ, **gloo_on_loopback("127.0.0.1"), REPORT_DIR: str(reports), "PYTHONUNBUFFERED": "1"}
        env.pop(STOP_AT_STEP, None)
        if stop_at is not None:
            env[STOP_AT_STEP] = str(stop_at)
        console = self.work / name / "console.txt"
        start = time.monotonic()
        with open(console, "wb") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=self.work,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=self.timeout_s + (self.grace_s if stop_at else 0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = None
        found = {}
        for rank in range(ranks):
            path = reports / f"rank_{rank}.json"
            found[rank] = json.loads(path.read_text()) if path.exists() else None
        return Run(name, ranks, returncode, found, out_dir, log_dir, console, time.monotonic() - start)

    # -- the checks ---------------------------------------------------------------------------------------------
    def _ran(self, result: Result, run: Run, what: str) -> bool:
        if run.returncode is None:
            return result.add(what, False, f"{run.name} did not finish within {self.timeout_s:.0f} s: a rank may wait "
                                           f"in a collective the others never join; its output:\n{run.tail()}")
        bad = {r: rep for r, rep in run.reports.items() if rep is None or rep["exit_code"] != 0}
        if run.returncode != 0 or bad:
            said = []
            for r, rep in bad.items():
                said.append(f"rank {r}: " + ("no report: killed before it could exit" if rep is None else
                                             f"exit code {rep['exit_code']}" + (f"\n{rep['error'].rstrip()}"
                                                                                if rep.get("error") else "")))
            return result.add(what, False, f"{run.name} failed (torchrun exit code {run.returncode}). "
                                           + "; ".join(said) + f"\n    output:\n{run.tail()}")
        steps = {r: rep["steps"] for r, rep in run.reports.items()}
        if set(steps.values()) != {self.steps}:
            return result.add(what, False, f"{run.name}: optimizer steps per rank {steps}, expected {self.steps} on "
                                           "each: does the script take its number of steps from the arguments?")
        return result.add(what, True, f"{run.ranks} rank(s), {self.steps} optimizer steps each, exit 0, "
                                      f"{run.seconds:.0f} s")

    def _rank_logs(self, result: Result, run: Run) -> bool:
        files = [p for p in run.log_dir.rglob("*") if p.is_file() and p.stat().st_size > 0] if run.log_dir.exists() else []
        missing = []
        for rank in range(run.ranks):
            names = (f"rank_{rank}", f"rank{rank}", f"rank-{rank}")
            if not any(any(n in part for n in names for part in p.relative_to(run.log_dir).parts) for p in files):
                missing.append(rank)
        if missing:
            return result.add("per-rank logs", False,
                              f"no log file under the log folder names rank(s) {missing} ({len(files)} file(s) there: "
                              f"{[str(p.relative_to(run.log_dir)) for p in files[:4]]}): every rank should write its "
                              "own file, e.g. <log_dir>/rank_<r>/train.log with logging.FileHandler, so that a failing "
                              "rank's last lines can be read after the job")
        return result.add("per-rank logs", True, f"{len(files)} non-empty file(s), one per rank at least")

    def _samplers(self, result: Result, run: Run) -> bool:
        for rank, rep in run.reports.items():
            for sampler in rep["samplers"]:
                epochs = sampler["epochs"]
                repeated = len(epochs) != len(set(epochs))
                if sampler["shuffle"] and repeated:
                    return result.add("set_epoch", False,
                                      f"rank {rank}: a DistributedSampler(shuffle=True) was iterated {len(epochs)} times "
                                      f"with epochs {epochs}: without sampler.set_epoch(epoch) before each epoch every "
                                      "epoch repeats the first one's order, on every rank. Call set_epoch(epoch) at the "
                                      "start of each epoch (and set it from the step when resuming)")
        used = sum(len(rep["samplers"]) for rep in run.reports.values())
        return result.add("set_epoch", True, f"{used} DistributedSampler(s) seen; none repeats a shuffled epoch"
                          if used else "no DistributedSampler in the script (nothing to check)")

    def _writers(self, result: Result, run: Run) -> bool:
        for rank, rep in sorted(run.reports.items()):
            plain = [s["path"] for s in rep["saves"] if not s.get("sharded")]
            if rank != 0 and plain:
                return result.add("one checkpoint writer", False,
                                  f"rank {rank} wrote {plain[0]} with torch.save: with DDP every rank holds the same "
                                  "weights, so ranks other than 0 must not save (they would race on one file, and on a "
                                  "cluster's shared file system N ranks write N copies). Save on rank 0 only, then "
                                  "dist.barrier() so that no rank reads it before it is complete")
        saves = len(run.reports[0]["saves"]) if run.reports.get(0) else 0
        if not saves:
            return result.add("one checkpoint writer", False, "rank 0 saved nothing with torch.save or "
                                                              "torch.distributed.checkpoint: save a checkpoint to resume from")
        return result.add("one checkpoint writer", True, f"rank 0 saved {saves} time(s), no other rank wrote")

    def _equal_losses(self, result: Result, one: Run, many: Run) -> bool:
        a, b = one.losses(), many.losses()
        if None in a or None in b or not a:
            return result.add("equal losses", False, "no loss was recorded at some step: the probe records the scalar "
                                                     "passed to backward(); call loss.backward() on the step's loss")
        for step, (x, y) in enumerate(zip(a, b), start=1):
            if abs(x - y) > RTOL * max(abs(x), abs(y), 1e-12):
                return result.add("equal losses", False,
                                  f"step {step}: 1 rank {x:.6f}, {many.ranks} ranks {y:.6f} (mean of the ranks' losses). "
                                  f"With the same global batch the two runs must take the same steps: each rank reads "
                                  f"global_batch / world_size rows, different rows on each rank (DistributedSampler or "
                                  f"a slice by rank), the same seed for the model on every rank, and the gradients "
                                  f"averaged (DDP). Losses per step, 1 rank: {[round(v, 5) for v in a[:step]]}, "
                                  f"{many.ranks} ranks: {[round(v, 5) for v in b[:step]]}")
        return result.add("equal losses", True, f"{len(a)} steps, 1 rank = {many.ranks} ranks to rtol {RTOL:g} "
                                                f"(first {a[0]:.4f}, last {a[-1]:.4f})")

    def _stopped(self, result: Result, run: Run) -> int | None:
        """The step the stopped run checkpointed at (every rank agreeing), or None after a failed check."""
        name = "clean exit on SIGTERM"
        if run.returncode is None:
            result.add(name, False, f"the run did not end within {self.grace_s:.0f} s of SIGTERM: a rank that stops "
                                    "while another still steps leaves it waiting in a collective. Agree on the stop "
                                    "step: put the flag in a tensor and all_reduce it (MAX) each step, then every rank "
                                    f"stops after the same step.\n    output:\n{run.tail()}")
            return None
        sent = self.work / run.name / "reports" / "signal.json"
        if not sent.exists():
            result.add(name, False, f"the run ended before rank 0 finished step {self.stop_at}, so no SIGTERM was "
                                    f"sent (torchrun exit code {run.returncode})\n    output:\n{run.tail()}")
            return None
        handler = json.loads(sent.read_text())["handler"]
        dead = [r for r, rep in run.reports.items() if rep is None]
        if dead:
            had = {"default": "the script had no SIGTERM handler, so the signal's default action killed the process",
                   "ignored": "the script ignored SIGTERM, so torchrun killed the workers after its grace period",
                   "installed": "the script had a SIGTERM handler, but the process still died"}[handler]
            result.add(name, False, f"rank(s) {dead} ended without exiting through Python after SIGTERM ({had}). A "
                                    "scheduler sends SIGTERM before it kills a job (a time limit, a preemption, "
                                    "scancel): install a handler that sets a flag, finish the step, checkpoint, and "
                                    "return normally")
            return None
        codes = {r: rep["exit_code"] for r, rep in run.reports.items()}
        if set(codes.values()) != {0}:
            errors = [rep["error"] for rep in run.reports.values() if rep.get("error")]
            result.add(name, False, f"exit codes after SIGTERM {codes}: exit 0 after the checkpoint, so that the "
                                    "launcher does not count it as a failure and restart the workers"
                                    + (f"\n{errors[0].rstrip()}" if errors else ""))
            return None
        steps = {r: rep["steps"] for r, rep in run.reports.items()}
        if len(set(steps.values())) != 1:
            result.add(name, False, f"the ranks stopped after different steps {steps}: they must agree on the stop "
                                    "step (all_reduce the stop flag each step)")
            return None
        done = steps[0]
        if done >= self.steps:
            result.add(name, False, f"the run went on to its last step ({done}) after SIGTERM at step "
                                    f"{self.stop_at}: stop after the current step when SIGTERM arrives")
            return None
        saved_after = [s for s in run.reports[0]["saves"] if s["after_step"] >= self.stop_at]
        if not saved_after:
            result.add(name, False, f"no checkpoint was written after SIGTERM (it came after step {self.stop_at}; the "
                                    f"ranks stopped after step {done}): save one before exiting")
            return None
        result.add(name, True, f"SIGTERM after step {self.stop_at}: every rank stopped after step {done}, "
                               f"checkpointed, exit 0")
        return done

    def _resumed(self, result: Result, full: Run, stopped_at: int, resumed: Run) -> bool:
        name = "resume from the checkpoint"
        if not self._ran_quietly(resumed):
            return result.add(name, False, f"the resumed run failed (torchrun exit code {resumed.returncode})"
                                           + "".join(f"\n{rep['error'].rstrip()}" for rep in resumed.reports.values()
                                                     if rep and rep.get("error")) + f"\n    output:\n{resumed.tail()}")
        done = resumed.reports[0]["steps"]
        if done >= self.steps:
            return result.add(name, False, f"the resumed run took all {done} steps again: it did not load the "
                                           f"checkpoint (resume arguments {self.resume_args})")
        first = self.steps - done + 1
        if first <= stopped_at:
            return result.add(name, False, f"the resumed run started at step {first}, but the stopped run had finished "
                                           f"step {stopped_at}: {stopped_at - first + 1} step(s) were lost, so save "
                                           "the checkpoint when the signal arrives")
        if first != stopped_at + 1:
            return result.add(name, False, f"the resumed run started at step {first}, after the stopped run's last "
                                           f"step {stopped_at}: steps {stopped_at + 1}..{first - 1} were skipped")
        expected, got = full.losses()[first - 1:], resumed.losses()
        for i, (x, y) in enumerate(zip(expected, got), start=first):
            if y is None or abs(x - y) > RTOL * max(abs(x), abs(y), 1e-12):
                return result.add(name, False, f"step {i}: the uninterrupted run's loss {x:.6f}, the resumed run's {y}: "
                                               "restore the model, the optimizer and learning-rate schedule, and the "
                                               "data position (which batches come next)")
        return result.add(name, True, f"continued at step {first}; steps {first}..{self.steps} equal the "
                                      "uninterrupted run's")

    @staticmethod
    def _ran_quietly(run: Run) -> bool:
        return run.returncode == 0 and all(rep and rep["exit_code"] == 0 for rep in run.reports.values())

    def run(self, say=print, only: str | None = None) -> Result:
        """Every check, in order, stopping at the first run that fails one. only="stop": the SIGTERM run alone
        (one launch: quicker while working on the stop)."""
        if only not in (None, "stop"):
            raise ValueError(f"only must be None or 'stop', got {only!r}")
        result = Result(str(self.script))
        say(f"capstone: {self.script} under torchrun; work folder {self.work}")
        if only == "stop":
            stopped = self.launch("stopped", self.ranks, run_dir="stopped", stop_at=self.stop_at)
            result.runs.append(stopped)
            self._stopped(result, stopped)
            return result
        many = self.launch("ranks_2", self.ranks)
        result.runs.append(many)
        if not (self._ran(result, many, f"runs on {self.ranks} ranks") and self._rank_logs(result, many)
                and self._samplers(result, many) and self._writers(result, many)):
            return result
        one = self.launch("rank_1", 1)
        result.runs.append(one)
        if not (self._ran(result, one, "runs on 1 rank") and self._equal_losses(result, one, many)):
            return result
        stopped = self.launch("stopped", self.ranks, run_dir="stopped", stop_at=self.stop_at)
        result.runs.append(stopped)
        stopped_at = self._stopped(result, stopped)
        if stopped_at is None:
            return result
        resumed = self.launch("resumed", self.ranks, run_dir="stopped", resume=True)
        result.runs.append(resumed)
        self._resumed(result, many, stopped_at, resumed)
        return result

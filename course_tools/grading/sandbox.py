"""Run each exercise's tests on the learner's answer in a fresh process, outside the learner's kernel.

    results = grade("solutions/session_a/02_model_from_scratch.ipynb", {"alice": answers_in(alice_notebook)})
    results["alice"]["ex1_rmsnorm_tests"].passed

Why: nbgrader runs hidden tests in the learner's own kernel, after the learner's cells, so an answer can
change the kernel (an IPython AST transformer that wraps every later cell in try/except), the checks
(`torch.testing.assert_close = ...`) or the reference they read. Here nothing the learner ran survives:

1. one sandbox process per notebook (`python -m course_tools.grading.sandbox`) runs the notebook's
   `parameters` and read-only setup cells, taken from the instructor's notebook, never the submission;
2. for every exercise and submission it reads the learner's answer cells (audit.py refuses what is not an
   answer, with the line and the reason) and forks a child: the child runs only that exercise's answer
   cells, then its test cell (visible and hidden tests) from the instructor's notebook, and exits 0 only if
   every line ran. Nothing the child does reaches its parent, the other exercises or the other learners;
3. the verdict is the child's exit status, read by the sandbox; output and traceback come back as text.

So each exercise is graded on its own (a mistake costs only its points), and the imports of the setup
cells are paid once per notebook, not once per exercise. A child that runs longer than `timeout_s` is
killed with every process it started (ranks included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

from course_tools.grading.audit import audit
from course_tools.grading.exercises import read_exercises
from course_tools.grading.integrity import RANK_CONTEXT, Snapshot, guard_modules, trust

DEFAULT_TIMEOUT_S = 150.0
OUTPUT_LIMIT = 20_000  # characters of a check's output kept (the end, where the failure is)


@dataclass
class CheckResult:
    passed: bool
    output: str          # what the tests printed
    error: str           # why it failed: the audit's findings or the traceback ("" when passed)
    seconds: float

    @property
    def error_name(self) -> str:
        return self.error.strip().splitlines()[-1].split(":")[0] if self.error.strip() else ""


Results = dict[str, dict[str, CheckResult]]
"""student -> test cell id -> result."""


# ------------------------------------------------------------------ caller's side

def grade(source: Path | str, submissions: dict[str, dict[str, str]], *,
          only: list[str] | dict[str, list[str]] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Results:
    """Grade every submission ({student: {answer cell id: code}}) against the instructor notebook `source`.

    only: the test cell ids to grade, for every student (a list) or per student ({student: [test id, ...]});
    default: all of them. Returns {student: {test cell id: CheckResult}}.
    """
    notebook = read_exercises(source)
    known = {e.test_id for e in notebook.exercises}
    wanted = {student: set(known if only is None else only.get(student, ()) if isinstance(only, dict) else only)
              for student in submissions}
    unknown = sorted(set().union(*wanted.values()) - known) if wanted else []
    if unknown:
        raise KeyError(f"{Path(source).name} has no autograded test cells {unknown}; it has {sorted(known)}")
    checks = []
    for exercise in notebook.exercises:
        for student, answers in submissions.items():
            if exercise.test_id not in wanted[student]:
                continue
            missing = [cell for cell in exercise.answer_ids if cell not in answers]
            checks.append({
                "student": student, "test_id": exercise.test_id, "context_upto": exercise.context_upto,
                "answers": [[cell, answers.get(cell, ""), reference]
                            for cell, reference in zip(exercise.answer_ids, exercise.references)],
                "missing": missing, "test_code": exercise.test_code, "timeout_s": timeout_s})
    results: Results = {student: {} for student in submissions}
    if not checks:
        return results
    job = {"context": list(notebook.context), "checks": checks}
    env = dict(os.environ)
    from course_lib.runtime.launch import START_METHOD_VARIABLE  # here: nbgrader imports this module for every command

    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors; and fork is safe only before a thread pool starts
    # Checks launch ranks from a child that has imported torch already: forking them skips a fresh interpreter
    # and a torch import per rank (course_lib.runtime.launch.START_METHOD_VARIABLE).
    env.setdefault(START_METHOD_VARIABLE, "fork")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                     env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="grading-") as scratch:
        process = subprocess.run([sys.executable, "-m", "course_tools.grading.sandbox"], input=json.dumps(job),
                                 capture_output=True, text=True, cwd=scratch, env=env,
                                 timeout=60 + len(checks) * (timeout_s + 5))
    for line in process.stdout.splitlines():
        record = json.loads(line)
        student, test_id = record.pop("student"), record.pop("test_id")
        results[student][test_id] = CheckResult(**record)
    lost = [(c["student"], c["test_id"]) for c in checks if c["test_id"] not in results[c["student"]]]
    if lost:
        raise RuntimeError(f"the grading sandbox for {source} ended (exit {process.returncode}) before grading "
                           f"{lost}:\n{process.stderr[-4000:]}")
    return results


# ------------------------------------------------------------------ the sandbox process

def _origin(value) -> str:
    """Where a setup name comes from: a module's name, or the module that defines the object or its type."""
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    return str(getattr(value, "__module__", None) or type(value).__module__)


class _Sandbox:
    def __init__(self, job: dict, report_fd: int, folder: Path):
        self.job, self.report_fd, self.folder = job, report_fd, folder
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = self.main  # mock.patch("__main__.name") in tests reaches the cells' globals
        self.context_ran = 0
        self.context_error = ""
        self.files = 0
        self.setup_files: list[str] = []

    def source_file(self, code: str, label: str) -> str:
        """Write code to a file, so tracebacks quote it and inspect.getsource (spawnable) can read it back."""
        self.files += 1
        path = self.folder / f"{self.files:03d}_{label}.py"
        path.write_text(code)
        return str(path)

    def run_context(self, upto: int) -> None:
        while self.context_ran < upto and not self.context_error:
            code = self.job["context"][self.context_ran]
            try:
                path = self.source_file(code, f"setup_{self.context_ran}")
                self.setup_files.append(path)
                exec(compile(code, path, "exec"), self.main.__dict__)
            except BaseException:  # noqa: BLE001 - an instructor's setup cell failed: every later check says so
                self.context_error = "a setup cell of the notebook failed:\n" + traceback.format_exc()
            self.context_ran += 1

    def report(self, check: dict, passed: bool, output: str, error: str, seconds: float) -> None:
        record = {"student": check["student"], "test_id": check["test_id"], "passed": passed,
                  "output": output[-OUTPUT_LIMIT:], "error": error[-OUTPUT_LIMIT:], "seconds": round(seconds, 3)}
        os.write(self.report_fd, (json.dumps(record) + "\n").encode())

    def grade(self, check: dict) -> None:
        start = time.perf_counter()
        self.run_context(check["context_upto"])
        if self.context_error:
            return self.report(check, False, "", self.context_error, time.perf_counter() - start)
        if check["missing"]:
            return self.report(check, False, "", f"the answer cells {check['missing']} are missing from the "
                               "submission (restore them from the released notebook)", time.perf_counter() - start)
        context = {name: _origin(value) for name, value in self.main.__dict__.items() if not name.startswith("__")}
        findings = [f"{cell}, {violation}" for cell, answer, reference in check["answers"]
                    for violation in audit(answer, reference, context, check["test_code"])]
        if findings:
            return self.report(check, False, "", "AnswerRefused: the answer was not run, because\n  "
                               + "\n  ".join(findings), time.perf_counter() - start)
        out_path, err_path = self.folder / "out.txt", self.folder / "err.txt"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            self.run_child(check, out_path, err_path)
        status = self.wait(pid, check["timeout_s"])
        output = out_path.read_text(errors="replace") if out_path.exists() else ""
        error = err_path.read_text(errors="replace") if err_path.exists() else ""
        if status is None:
            error += f"\nTimeout: the check ran longer than {check['timeout_s']:g} s and was stopped"
        elif os.WIFSIGNALED(status):
            error += f"\nKilled: the check's process ended by signal {signal.Signals(os.WTERMSIG(status)).name}"
        passed = status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        if not passed and not error.strip():
            error = f"the check's process exited with status {os.WEXITSTATUS(status)} without a traceback"
        self.report(check, passed, output, "" if passed else error, time.perf_counter() - start)

    def run_child(self, check: dict, out_path: Path, err_path: Path) -> None:
        code = 1
        try:
            os.setpgid(0, 0)  # its own process group: a timeout kills it and every rank it started
            os.close(self.report_fd)
            for fd, path in ((1, out_path), (2, err_path)):
                handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(handle, fd)
                os.close(handle)
            namespace = self.main.__dict__
            # What the checks judge with, before the answer runs: verified after the answer and after the tests,
            # and by every rank the tests launch (the launcher's rank context: integrity.graded_rank).
            from course_lib.runtime.launch import RANK_CONTEXT_VARIABLE

            snapshot = Snapshot.take(namespace, [name for name in namespace if not name.startswith("__")])
            os.environ[RANK_CONTEXT_VARIABLE] = RANK_CONTEXT
            test_file = self.source_file(check["test_code"], check["test_id"])
            for path in self.setup_files + [test_file]:  # the instructor's code; the answers are not trusted
                trust(path)
            guard_modules()
            for cell, answer, _ in check["answers"]:
                exec(compile(answer, self.source_file(answer, f"answer_{cell}"), "exec"), namespace)
            snapshot.verify("after your answer ran")
            exec(compile(check["test_code"], test_file, "exec"), namespace)
            snapshot.verify("after the tests ran", names=False)
            code = 0
        except BaseException:  # noqa: BLE001 - every failure, SystemExit included, is a failed check
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    @staticmethod
    def wait(pid: int, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if time.monotonic() > deadline:
                for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                    try:
                        target()
                    except ProcessLookupError:
                        pass
                os.waitpid(pid, 0)
                return None
            time.sleep(0.02)


def warm_up() -> None:
    """Import, once in the sandbox, what nearly every check would import on its own after the fork: torch, and
    torch._dynamo, which torch imports at the first optimizer a process builds (about a second each time, in
    every check and in every rank a check forks)."""
    import torch
    import torch._dynamo  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def main() -> int:
    job = json.loads(sys.stdin.read())
    warm_up()
    report_fd = os.dup(1)  # results go here; the cells' own prints go to a log nobody reads
    with tempfile.TemporaryDirectory(prefix="sandbox-") as folder:
        log = os.open(Path(folder) / "setup.log", os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(log, 1)
        os.close(log)
        sandbox = _Sandbox(job, report_fd, Path(folder))
        for check in sorted(job["checks"], key=lambda c: c["context_upto"]):
            sandbox.grade(check)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run each exercise's tests on the learner's answer in a fresh process, outside the learner's kernel.

    results = grade("solutions/session_a/02_model_from_scratch.ipynb", {"alice": answers_in(alice_notebook)})
    results["alice"]["ex1_rmsnorm_tests"].passed

Why: nbgrader runs hidden tests in the learner's own kernel, after the learner's cells, so an answer can
change the kernel (an IPython AST transformer that wraps every later cell in try/except), the checks
(`torch.testing.assert_close = ...`) or the reference they read. Here nothing the learner ran survives:

1. one sandbox process per notebook (`python -m course_tools.grading.sandbox`) runs the notebook's
   `parameters` and read-only setup cells, taken from the instructor's notebook, never the submission;
2. for every exercise and submission it reads the learner's answer cells (audit.py refuses what is not an
   answer, with the line and the reason) and starts a child: the child runs only that exercise's answer
   cells, then its test cell (visible and hidden tests) from the instructor's notebook, and exits 0 only if
   every line ran. Nothing the child does reaches its parent, the other exercises or the other learners.
   On Linux the child is forked from the sandbox, which has run the setup cells already; on macOS, where a
   process that has imported torch (and with it Apple's frameworks) must not fork, the child is a fresh
   interpreter that runs the setup cells itself (`start_method()`: COURSE_LAUNCH_START_METHOD=spawn forces that
   path on Linux, as the tests do);
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
from course_tools.grading.integrity import RANK_CONTEXT, Snapshot, guard_modules, settle_torch, trust

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

def start_method() -> str:
    """How the sandbox starts a check's process, and the check its ranks: "fork" on Linux (a check forks from the
    sandbox that ran the setup cells, its ranks from the check), "spawn" elsewhere (macOS: a fresh interpreter per
    check and per rank). The launcher's variable, COURSE_LAUNCH_START_METHOD, sets both: "spawn" or "forkserver"
    gives every check a fresh interpreter."""
    from course_lib.runtime.launch import START_METHOD_VARIABLE  # here: nbgrader imports this module for every command

    return os.environ.get(START_METHOD_VARIABLE) or ("fork" if sys.platform.startswith("linux") else "spawn")


def grade(source: Path | str, submissions: dict[str, dict[str, str]], *,
          only: list[str] | dict[str, list[str]] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
          method: str | None = None) -> Results:
    """Grade every submission ({student: {answer cell id: code}}) against the instructor notebook `source`.

    only: the test cell ids to grade, for every student (a list) or per student ({student: [test id, ...]});
    default: all of them. method: how checks and their ranks start, "fork" or "spawn" (default: start_method()).
    Returns {student: {test cell id: CheckResult}}.
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
    from course_lib.runtime.launch import START_METHOD_VARIABLE

    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors; and fork is safe only before a thread pool starts
    # On Linux checks launch ranks from a child that has imported torch already: forking them skips a fresh
    # interpreter and a torch import per rank. On macOS, spawn (see start_method).
    env[START_METHOD_VARIABLE] = method or start_method()
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
        self.fork = start_method() == "fork"
        self.checks_started = 0

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
        child = None
        if self.fork:
            pid = os.fork()
            if pid == 0:  # the child: never returns
                self.run_child(check, out_path, err_path)
        else:  # a fresh interpreter, which runs the setup cells itself, then the same run_child
            for path in (out_path, err_path):
                path.unlink(missing_ok=True)
            self.checks_started += 1
            folder = self.folder / f"check_{self.checks_started:03d}"
            folder.mkdir()
            (folder / "check.json").write_text(json.dumps({"context": self.job["context"], "check": check,
                                                           "out": str(out_path), "err": str(err_path)}))
            child = subprocess.Popen([sys.executable, "-m", "course_tools.grading.sandbox", "--check",
                                      str(folder / "check.json")], start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            pid = child.pid
        status = self.wait(pid, check["timeout_s"], child)
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
            if self.report_fd is not None:  # forked: its own process group (a spawned check has its own session)
                os.setpgid(0, 0)  # a timeout kills it and every rank it started
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
    def wait(pid: int, timeout_s: float, child: subprocess.Popen | None = None):
        """The child's wait status (os.waitpid's), or None when it ran past timeout_s and was killed with every
        process of its group. A Popen child is waited for through its object (which would otherwise reap it)."""
        def poll():
            if child is None:
                return os.waitpid(pid, os.WNOHANG)
            code = child.poll()
            return (0, 0) if code is None else (pid, -code if code < 0 else code << 8)

        deadline = time.monotonic() + timeout_s
        while True:
            done, status = poll()
            if done:
                return status
            if time.monotonic() > deadline:
                for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                    try:
                        target()
                    except ProcessLookupError:
                        pass
                child.wait() if child is not None else os.waitpid(pid, 0)
                return None
            time.sleep(0.02)


def warm_up() -> None:
    """Import, once in the sandbox, what nearly every check would import on its own after the fork: torch, and
    torch._dynamo, which torch imports at the first optimizer a process builds (about a second each time, in
    every check and in every rank a check forks; integrity.settle_torch)."""
    settle_torch()


def check_main(path: str) -> None:
    """A check in a fresh interpreter (the spawn path): the setup cells up to the exercise, then run_child."""
    payload = json.loads(Path(path).read_text())
    check = payload["check"]
    warm_up()  # before the snapshot, as in the sandbox the fork path starts from
    log = os.open(Path(path).parent / "setup.log", os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.close(log)
    sandbox = _Sandbox({"context": payload["context"]}, None, Path(path).parent)
    sandbox.run_context(check["context_upto"])
    if sandbox.context_error:  # the sandbox ran the same cells without error: say what differs here
        Path(payload["err"]).write_text(sandbox.context_error)
        os._exit(1)
    sandbox.run_child(check, Path(payload["out"]), Path(payload["err"]))


def main() -> int:
    if sys.argv[1:2] == ["--check"]:
        check_main(sys.argv[2])
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

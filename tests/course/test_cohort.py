"""The cohort commands of the instructor guide (book/instructor/index.md) work with this course's nbgrader setup:
import the class list, add and release an assignment through an exchange, fetch and submit as a learner, collect,
and export the grades to CSV. Grading itself is tests/course/test_grading.py's. Runs in a scratch course and a
scratch exchange (slow: eight nbgrader commands)."""

import csv
import getpass
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
COURSE_ID = "distributed-llm-training"
GUIDE = REPO_ROOT / "book" / "instructor" / "sources" / "index.md.in"


def nbgrader(*args, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # alembic
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, f"nbgrader {' '.join(args)}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout + done.stderr


def test_release_fetch_submit_collect_and_export_through_an_exchange(tmp_path):
    course, learner, exchange = tmp_path / "course", tmp_path / "learner", tmp_path / "exchange"
    for folder in (course, learner, exchange):
        folder.mkdir()
    shutil.copy(REPO_ROOT / "nbgrader_config.py", course)
    shutil.copytree(REPO_ROOT / "notebooks" / "session_a", course / "notebooks" / "session_a")
    me = getpass.getuser()  # the exchange knows a learner by the account that submits
    (course / "students.csv").write_text(f"id,first_name,last_name,email\n{me},Ada,Lovelace,\nbob,Bob,Ross,\n")
    ex = f"--Exchange.root={exchange}"
    guide = GUIDE.read_text()
    for command in ("db student import students.csv", "db assignment add session_a",
                    "release_assignment session_a $EX", "collect session_a $EX", "export --to grades.csv",
                    f"fetch_assignment session_a --course {COURSE_ID} $EX",
                    f"submit session_a --course {COURSE_ID} $EX"):
        assert command in guide, f"the guide no longer shows `{command}`: update this test with it"

    nbgrader("db", "student", "import", "students.csv", cwd=course)
    nbgrader("db", "assignment", "add", "session_a", cwd=course)
    nbgrader("release_assignment", "session_a", ex, cwd=course)
    nbgrader("fetch_assignment", "session_a", "--course", COURSE_ID, ex, cwd=learner)
    fetched = sorted(p.name for p in (learner / "session_a").glob("*.ipynb"))
    assert fetched == sorted(p.name for p in (REPO_ROOT / "notebooks" / "session_a").glob("*.ipynb"))
    answer = learner / "session_a" / "04_lab1.ipynb"
    answer.write_text(answer.read_text().replace("loss_prediction = None", "loss_prediction = \"lower\"", 1))
    nbgrader("submit", "session_a", "--course", COURSE_ID, ex, cwd=learner)
    nbgrader("collect", "session_a", ex, cwd=course)
    submitted = course / "submitted" / me / "session_a"
    assert sorted(p.name for p in submitted.glob("*.ipynb")) == fetched
    assert (submitted / "04_lab1.ipynb").read_text() == answer.read_text()  # the learner's own copy arrived
    nbgrader("export", "--to", "grades.csv", cwd=course)
    rows = list(csv.DictReader((course / "grades.csv").open()))
    assert {(r["assignment"], r["student_id"], r["last_name"]) for r in rows} == {
        ("session_a", me, "Lovelace"), ("session_a", "bob", "Ross")}

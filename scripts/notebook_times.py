"""How long the course takes: every notebook run at its default parameters and timed cell by cell, and the
instructor's pages and the study plan written from those measurements.

    python scripts/notebook_times.py measure                    # every notebook (tens of minutes on 2 cores)
    python scripts/notebook_times.py measure session_c/04b_tokenizer session_a/03_training_loop
    python scripts/notebook_times.py render                     # the pages, from book/instructor/notebook_times.json
    python scripts/notebook_times.py check                      # exit 1 if a page differs from a fresh render

measure: runs each notebook with papermill at the defaults of its parameters cell (its out_dir and data_dir moved
to a temporary folder), lessons from notebooks/ and graded notebooks from solutions/ (a finished exercise
notebook: the answers in place, and its test cells run with their hidden tests), and records in notebook_times.json the whole
run's seconds, each code cell's seconds and the first lines it printed, and the machine (CPU, cores, torch, the
load before the run). A notebook measured again replaces its entry; the others stay. Measure on an idle machine:
the load is recorded, and a busy machine's figures are slow.

render: fills the templates book/instructor/sources/*.md.in into the pages book/instructor/*.md (the
study plan into book/reference/study_plan.md). A template names what it shows:
    {{ run session_a/03_training_loop }}            the notebook's whole run: "1 min 12 s"
    {{ cell session_a/03_training_loop train }}      one cell's seconds: "48 s"
    {{ output session_a/03_training_loop train 4 }}  the first 4 lines the cell printed, as a code block
    {{ session_run a }}                              every notebook of Session A, run one after the other
    {{ machine }}                                    where and when the figures were measured
    {{ study_plan_tables }}                          the study plan's tables (time per notebook and per session)
    {{ weekly_plan }}                                the plan in part-time weeks
A name that is not in the measurements is an error naming the template.

The study plan adds to each notebook's measured run the time to read it (words of its markdown cells at
READING_WPM words a minute) and EXERCISE_MINUTES per graded exercise (test cell), and each session's chapter
pages at the same reading speed; the weekly plan fills HOURS_PER_WEEK hours a week in the course's order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import nbformat
from grading import parameter_names  # scripts/ is on sys.path: this file's folder
from output_checks import is_graded

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMES_FILE = REPO_ROOT / "book" / "instructor" / "notebook_times.json"
TEMPLATES = REPO_ROOT / "book" / "instructor" / "sources"
PAGES = REPO_ROOT / "book" / "instructor"
STUDY_PLAN = REPO_ROOT / "book" / "reference" / "study_plan.md"
SESSIONS = "abcdef"
OUTPUT_LINES = 12
READING_WPM = 150  # technical prose with equations and code: slower than the 200-250 of plain text
EXERCISE_MINUTES = 20  # one graded test cell: read the contract, write the answer, run the checks, fix
HOURS_PER_WEEK = 10  # part-time: three evenings and a half day
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)((?:\s+[^\s}]+)*)\s*\}\}")


# ------------------------------------------------------------------------------------------ notebooks
def notebook_names(root: Path = REPO_ROOT) -> list[str]:
    """Every notebook of the course as session_x/name, in the course's order (sessions, then file names)."""
    return [f"{p.parent.name}/{p.stem}" for p in sorted((root / "notebooks").glob("session_*/*.ipynb"))]


def source_of(name: str, root: Path = REPO_ROOT) -> Path:
    """The notebook a learner runs: the student version of a lesson, the instructor version of an exercise
    notebook (the student version stops at the first unanswered exercise)."""
    student = root / "notebooks" / f"{name}.ipynb"
    if not student.exists():
        raise FileNotFoundError(f"no notebook {name}: expected {student}")
    return root / "solutions" / f"{name}.ipynb" if is_graded(student) else student


def printed(cell, lines: int = OUTPUT_LINES) -> list[str]:
    """The first lines a code cell printed (stdout, and plain-text results), without trailing blanks."""
    text = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            text.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data") and "text/plain" in out.get("data", {}):
            if "image/png" not in out["data"]:
                text.append(out["data"]["text/plain"] + "\n")
    return "".join(text).rstrip().splitlines()[:lines]


def machine() -> dict:
    import torch

    from course_lib.observability import machine_info

    info = machine_info()
    return {"cpu": info["cpu"], "cores": info["cores"], "torch": str(torch.__version__),
            "platform": f"{platform.system()} {platform.machine()}", "python": platform.python_version()}


def measure_one(name: str, scratch: Path) -> dict:
    import papermill

    path = source_of(name)
    nb = nbformat.read(path, as_version=4)
    declared = parameter_names(nb)
    parameters = {p: str(scratch / name / p) for p in ("out_dir", "data_dir") if p in declared}
    out = scratch / f"{name.replace('/', '_')}.ipynb"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    papermill.execute_notebook(str(path), str(out), parameters=parameters, kernel_name="python3",
                               cwd=str(path.parent), progress_bar=False, log_output=False, execution_timeout=1800)
    seconds = time.perf_counter() - start
    done = nbformat.read(out, as_version=4)
    cells = {}
    for cell in done.cells:
        if cell.cell_type != "code" or "injected-parameters" in cell.metadata.get("tags", []):
            continue
        cells[cell.id] = {"seconds": round(float(cell.metadata.get("papermill", {}).get("duration") or 0.0), 2),
                          "printed": printed(cell)}
    return {"seconds": round(seconds, 1), "load_before": None if load is None else round(load, 2),
            "ran": str(path.relative_to(REPO_ROOT)), "date": date.today().isoformat(), "cells": cells}


def measure(names: list[str], times_file: Path = TIMES_FILE) -> dict:
    known = notebook_names()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown notebook(s) {unknown}: names look like session_a/03_training_loop")
    data = json.loads(times_file.read_text()) if times_file.exists() else {"notebooks": {}}
    data["machine"] = machine()
    with tempfile.TemporaryDirectory(prefix="notebook-times-") as scratch:
        for name in names or known:
            print(f"{name} ...", end=" ", flush=True)
            data["notebooks"][name] = measure_one(name, Path(scratch))
            print(f"{data['notebooks'][name]['seconds']:.0f} s", flush=True)
            data["notebooks"] = {n: data["notebooks"][n] for n in known if n in data["notebooks"]}
            times_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = times_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
            os.replace(tmp, times_file)  # after every notebook: a long run stopped halfway keeps what it measured
    return data


# ------------------------------------------------------------------------------------------ the study plan
def words(text: str) -> int:
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)  # code is run, not read word by word
    return len(re.findall(r"[A-Za-z][A-Za-z'-]*", text))


def notebook_effort(name: str, root: Path = REPO_ROOT) -> dict:
    nb = nbformat.read(root / "notebooks" / f"{name}.ipynb", as_version=4)
    reading = sum(words(c.source) for c in nb.cells if c.cell_type == "markdown") / READING_WPM
    exercises = sum(1 for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade"))
    return {"reading_min": reading, "exercises": exercises, "exercise_min": exercises * EXERCISE_MINUTES}


def chapter_pages(session: str, root: Path = REPO_ROOT) -> list[Path]:
    return sorted((root / "book" / f"session_{session}").glob("*.md"))


def fmt_seconds(seconds: float) -> str:
    if seconds < 0.5:
        return "under 1 s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def fmt_minutes(minutes: float) -> str:
    minutes = round(minutes)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def session_rows(data: dict, session: str) -> list[dict]:
    rows = []
    for name in notebook_names():
        if not name.startswith(f"session_{session}/"):
            continue
        if name not in data["notebooks"]:
            raise KeyError(f"{name} has not been measured: python scripts/notebook_times.py measure {name}")
        effort = notebook_effort(name)
        run_min = data["notebooks"][name]["seconds"] / 60
        rows.append({"name": name, "run_min": run_min, **effort,
                     "total_min": run_min + effort["reading_min"] + effort["exercise_min"]})
    return rows


def chapter_minutes(session: str) -> float:
    return sum(words(p.read_text()) for p in chapter_pages(session)) / READING_WPM


def study_plan_tables(data: dict) -> str:
    out = ["| Notebook | Run (measured) | Reading | Graded exercises | Total |", "| --- | --- | --- | --- | --- |"]
    totals = []
    for s in SESSIONS:
        rows = session_rows(data, s)
        for r in rows:
            ex = f"{r['exercises']} x {EXERCISE_MINUTES} min" if r["exercises"] else "—"
            out.append(f"| `{r['name']}` | {fmt_seconds(r['run_min'] * 60)} | {fmt_minutes(r['reading_min'])} | "
                       f"{ex} | {fmt_minutes(r['total_min'])} |")
        chapters = chapter_minutes(s)
        totals.append((s, sum(r["run_min"] for r in rows), sum(r["reading_min"] for r in rows) + chapters,
                       sum(r["exercise_min"] for r in rows), len(rows)))
    out += ["", "| Session | Notebooks | Run (measured) | Reading (notebooks and chapter) | Graded exercises | Total |",
            "| --- | --- | --- | --- | --- | --- |"]
    for s, run, reading, exercises, count in totals:
        out.append(f"| {s.upper()} | {count} | {fmt_minutes(run)} | {fmt_minutes(reading)} | {fmt_minutes(exercises)} | "
                   f"{fmt_minutes(run + reading + exercises)} |")
    run, reading, exercises = (sum(t[i] for t in totals) for i in (1, 2, 3))
    out.append(f"| all | {sum(t[4] for t in totals)} | {fmt_minutes(run)} | {fmt_minutes(reading)} | "
               f"{fmt_minutes(exercises)} | {fmt_minutes(run + reading + exercises)} |")
    return "\n".join(out)


def session_hours(data: dict) -> list[tuple[str, float]]:
    return [(s, (sum(r["total_min"] for r in session_rows(data, s)) + chapter_minutes(s)) / 60) for s in SESSIONS]


def plan_weeks(data: dict) -> list[list[tuple]]:
    """Sessions in order, HOURS_PER_WEEK hours a week: per week, (session, hours, finishes it, continues it)."""
    weeks, week, left = [], [], float(HOURS_PER_WEEK)
    for s, hours in session_hours(data):
        remaining = hours
        while remaining > 1e-9:
            take = min(remaining, left)
            week.append((s, take, remaining - take <= 1e-9, remaining < hours - 1e-9))
            remaining -= take
            left -= take
            if left <= 1e-9:
                weeks.append(week)
                week, left = [], float(HOURS_PER_WEEK)
    if week:
        weeks.append(week)
    return weeks


def weekly_plan(data: dict) -> str:
    """The weeks of plan_weeks as a table."""
    out = [f"| Week | Sessions ({HOURS_PER_WEEK} h a week) | Hours |", "| --- | --- | --- |"]
    for i, week in enumerate(plan_weeks(data), start=1):
        parts = []
        for s, hours, finishes, continues in week:
            state = "the rest of " if continues and finishes else ("the start of " if not finishes and not continues
                                                                    else ("more of " if not finishes else ""))
            parts.append(f"{state}Session {s.upper()} ({hours:.1f} h)")
        out.append(f"| {i} | {'; '.join(parts)} | {sum(h for _, h, _, _ in week):.1f} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ rendering
def render_text(template: str, data: dict, where: str) -> str:
    notebooks = data["notebooks"]

    def entry(name: str) -> dict:
        if name not in notebooks:
            raise ValueError(f"{where}: {name} is not in {TIMES_FILE.name} (measure it: python "
                             f"scripts/notebook_times.py measure {name})")
        return notebooks[name]

    def cell(name: str, cell_id: str) -> dict:
        cells = entry(name)["cells"]
        if cell_id not in cells:
            raise ValueError(f"{where}: {name} has no code cell {cell_id!r} (its cells: {', '.join(cells)})")
        return cells[cell_id]

    def replace(match: re.Match) -> str:
        kind, args = match.group(1), match.group(2).split()
        if kind == "run" and len(args) == 1:
            return fmt_seconds(entry(args[0])["seconds"])
        if kind == "cell" and len(args) == 2:
            return fmt_seconds(cell(*args)["seconds"])
        if kind == "output" and len(args) in (2, 3):
            lines = cell(args[0], args[1])["printed"][:int(args[2]) if len(args) == 3 else OUTPUT_LINES]
            if not lines:
                raise ValueError(f"{where}: cell {args[1]} of {args[0]} printed nothing to show")
            return "```text\n" + "\n".join(lines) + "\n```"
        if kind == "session_run" and len(args) == 1 and args[0] in SESSIONS:
            names = [n for n in notebooks if n.startswith(f"session_{args[0]}/")]
            return fmt_seconds(sum(notebooks[n]["seconds"] for n in names))
        if kind == "machine" and not args:
            m = data["machine"]
            dates = sorted({e["date"] for e in notebooks.values()})
            loads = [e["load_before"] for e in notebooks.values() if e["load_before"] is not None]
            return (f"{m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']}, torch {m['torch']}; "
                    f"measured {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
                    + (f", load before each notebook at most {max(loads):.1f}" if loads else ""))
        if kind == "reading_wpm" and not args:
            return str(READING_WPM)
        if kind == "exercise_minutes" and not args:
            return str(EXERCISE_MINUTES)
        if kind == "hours_per_week" and not args:
            return str(HOURS_PER_WEEK)
        if kind == "weekly_weeks" and not args:
            return str(len(plan_weeks(data)))
        if kind == "study_plan_tables" and not args:
            return study_plan_tables(data)
        if kind == "weekly_plan" and not args:
            return weekly_plan(data)
        raise ValueError(f"{where}: unknown placeholder {match.group(0)!r}")

    return PLACEHOLDER.sub(replace, template)


def targets() -> dict[Path, Path]:
    """{template: page} for every template."""
    found = {}
    for template in sorted(TEMPLATES.glob("*.md.in")):
        name = template.name[:-len(".md.in")]
        found[template] = STUDY_PLAN if name == "study_plan" else PAGES / f"{name}.md"
    return found


GENERATED = ("<!-- Written by scripts/notebook_times.py render from book/instructor/sources/{name}: edit that file, "
             "then run `python scripts/notebook_times.py render`. -->\n")


def rendered(data: dict | None = None) -> dict[Path, str]:
    data = data or json.loads(TIMES_FILE.read_text())
    return {page: GENERATED.format(name=t.name) + render_text(t.read_text(), data, str(t.relative_to(REPO_ROOT)))
            for t, page in targets().items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run and time notebooks (all, or the ones named)")
    m.add_argument("names", nargs="*", help="session_x/notebook names (default: every notebook)")
    sub.add_parser("render", help="write the pages from the templates and the measurements")
    sub.add_parser("check", help="exit 1 if a page is not what render would write")
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.names)
        return 0
    try:
        pages = rendered()
    except (ValueError, KeyError) as err:
        parser.exit(2, f"{parser.prog}: error: {err.args[0] if err.args else err}\n")
    if args.command == "render":
        for page, text in pages.items():
            page.write_text(text)
            print(f"wrote {page.relative_to(REPO_ROOT)}")
        return 0
    stale = [str(p.relative_to(REPO_ROOT)) for p, text in pages.items() if not p.exists() or p.read_text() != text]
    if stale:
        print(f"out of date (run: python scripts/notebook_times.py render): {', '.join(stale)}", file=sys.stderr)
        return 1
    print(f"{len(pages)} page(s) up to date with {TIMES_FILE.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

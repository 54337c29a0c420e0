"""The instructor guide and the study plan are written from measurements (scripts/notebook_times.py): every notebook
is measured, every page is what a fresh render writes, the renderer refuses what it cannot fill, and the plan
built from the measurements is 3 to 4 part-time weeks."""

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import notebook_times as nt  # noqa: E402

DATA = json.loads(nt.TIMES_FILE.read_text())


def test_every_notebook_of_the_course_is_measured_with_its_cells():
    assert list(DATA["notebooks"]) == nt.notebook_names()
    for name, entry in DATA["notebooks"].items():
        assert entry["seconds"] > 0 and entry["cells"], name
        assert entry["seconds"] >= sum(c["seconds"] for c in entry["cells"].values()) * 0.99, name


def test_the_pages_are_what_a_fresh_render_writes():
    pages = nt.rendered(DATA)
    assert set(pages) == {nt.STUDY_PLAN, *(nt.PAGES / f"{n}.md" for n in ("index", *(f"session_{s}" for s in "abcdef")))}
    for page, text in pages.items():
        assert page.read_text() == text, f"{page.relative_to(REPO_ROOT)} is stale: python scripts/notebook_times.py render"
        assert "{{" not in text and "}}" not in text, page


def test_the_guide_and_plan_are_in_the_book():
    toc = yaml.safe_load((REPO_ROOT / "_toc.yml").read_text())
    files = re.findall(r"file: (\S+)", (REPO_ROOT / "_toc.yml").read_text())
    assert toc["parts"] and "book/instructor/index" in files and "book/reference/study_plan" in files
    assert all(f"book/instructor/session_{s}" in files for s in "abcdef")


def test_each_run_sheet_has_its_parts():
    for s in "abcdef":
        text = (nt.PAGES / f"session_{s}.md").read_text()
        assert "measured by `python scripts/notebook_times.py measure`" in text, s
        assert text.count("```text") >= 3, f"session {s}: what the live cells print"
        assert re.search(r"^#+ .*stall", text, flags=re.MULTILINE | re.IGNORECASE), f"session {s}: stall points"
        assert re.search(r"^#+ .*(answers|questions)", text, flags=re.MULTILINE | re.IGNORECASE), s


def test_the_study_plan_takes_3_to_4_part_time_weeks_and_adds_up():
    weeks = nt.plan_weeks(DATA)
    assert 3 <= len(weeks) <= 4, f"{len(weeks)} weeks at {nt.HOURS_PER_WEEK} h"
    hours = sum(h for _, h in nt.session_hours(DATA))
    assert sum(h for week in weeks for _, h, _, _ in week) == pytest.approx(hours)
    assert all(sum(h for _, h, _, _ in week) <= nt.HOURS_PER_WEEK + 1e-9 for week in weeks)
    run = sum(e["seconds"] for e in DATA["notebooks"].values()) / 60
    assert nt.fmt_minutes(run) in nt.study_plan_tables(DATA).splitlines()[-1]  # the "all" row's measured run


def test_the_renderer_names_what_it_cannot_fill():
    data = {"machine": DATA["machine"], "notebooks": {"session_a/x": {"seconds": 75.0, "date": "2026-01-01",
                                                                       "load_before": 0.5, "cells": {
                                                                           "c1": {"seconds": 2.5, "printed": ["a", "b"]},
                                                                           "c2": {"seconds": 1.0, "printed": []}}}}}
    assert nt.render_text("{{ run session_a/x }} / {{ cell session_a/x c1 }}", data, "t") == "1 min 15 s / 2 s"
    data["notebooks"]["session_a/x"]["cells"]["c1"]["seconds"] = 0.2
    assert nt.render_text("{{ cell session_a/x c1 }}", data, "t") == "under 1 s"
    data["notebooks"]["session_a/x"]["cells"]["c1"]["seconds"] = 2.5
    assert nt.render_text("{{ output session_a/x c1 1 }}", data, "t") == "```text\na\n```"
    with pytest.raises(ValueError, match=r"t: session_a/y is not in notebook_times\.json"):
        nt.render_text("{{ run session_a/y }}", data, "t")
    with pytest.raises(ValueError, match="t: session_a/x has no code cell 'c3'"):
        nt.render_text("{{ cell session_a/x c3 }}", data, "t")
    with pytest.raises(ValueError, match="cell c2 of session_a/x printed nothing"):
        nt.render_text("{{ output session_a/x c2 }}", data, "t")
    with pytest.raises(ValueError, match="unknown placeholder"):
        nt.render_text("{{ runs session_a/x }}", data, "t")

"""The debugging labs hide their diagnoses: nothing above a job's diagnosis answer names its cause or its fix,
every hint is folded, every job of course_lib.debugging is in a lab, and each job's diagnosis is graded."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from course_lib.debugging.checks import CAUSES, diagnosis_of, script_names
from course_lib.debugging.jobs import JOBS

REPO_ROOT = Path(__file__).resolve().parents[2]
LABS = [REPO_ROOT / "notebooks" / "session_c" / name for name in ("06_debugging_lab.ipynb", "07_debugging_lab_silent.ipynb")]

KEY_TERMS = {  # job -> words that would give away its cause or its fix
    "job_01": ["rank == 0", "only on rank 0", "only rank 0"],
    "job_02": ["rank == 0", "only on rank 0", "only rank 0", "eval_every == 0 and"],
    "job_03": ["all_gather", "uneven", "same shape", "6 and 5"],
    "job_04": ["drop_last", "Join", "one more batch", "pads"],
    "job_05": ["swap", "rank 0 evaluates", "evaluates first"],
    "job_06": ["module.", "prefixed", "unwrap"],
    "job_07": ["barrier", "race", "before rank 0"],
    "job_08": ["find_unused_parameters", "unused", "aux_head"],
    "job_09": ["set_epoch"],
    "job_10": ["broadcast", "before wrapping", "only rank 0 loads"],
    "job_11": ["no_sync"],
    "job_12": ["get_world_size", "divides by the number of ranks"],
    "job_13": ["len(micro_batches)", "divide each micro-batch"],
}


def cells(path: Path):
    return nbformat.read(path, as_version=4).cells


def grade_id(cell) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "")


def job_of(cell) -> str | None:
    """The job a cell runs (`run_job("job_07", ...)`), if any."""
    found = re.search(r'run_job\("(job_\d+)"', cell.source)
    return found.group(1) if found else None


def diagnosis_cells() -> list[tuple[Path, int, str]]:
    """(lab, index of a diagnosis answer cell, its job)."""
    found = []
    for lab in LABS:
        job = None
        for i, cell in enumerate(cells(lab)):
            job = job_of(cell) or job
            if grade_id(cell).endswith("_diagnosis"):
                found.append((lab, i, job))
    return found


def test_every_job_is_diagnosed_and_fixed_in_a_lab():
    jobs = [job for _, _, job in diagnosis_cells()]
    assert sorted(jobs) == sorted(JOBS) == sorted(KEY_TERMS)
    for lab in LABS:
        ids = [grade_id(c) for c in cells(lab) if grade_id(c)]
        for n in {int(i[3:].split("_")[0]) for i in ids if i.startswith("dbg")}:
            assert {f"dbg{n}_diagnosis", f"dbg{n}_diagnosis_tests", f"dbg{n}_fix", f"dbg{n}_fix_tests"} <= set(ids)


def leaks(lab: Path, index: int, job: str) -> list[str]:
    above = "\n".join(cell.source for cell in cells(lab)[:index])
    return [term for term in KEY_TERMS[job]
            if re.search(rf"(?<![\w.]){re.escape(term)}(?![\w(])", above, flags=re.IGNORECASE)]


@pytest.mark.parametrize(("lab", "index", "job"), diagnosis_cells(), ids=lambda v: v if isinstance(v, str) else None)
def test_nothing_above_a_diagnosis_names_its_cause_or_fix(lab, index, job):
    assert not leaks(lab, index, job), f"{lab.name}: above the diagnosis of {job}, the text gives away {leaks(lab, index, job)}"


def test_the_leak_check_finds_answers_written_above_a_diagnosis():
    """In the instructor's notebook, job 1's fixed `train` (with its `if rank == 0:`) stands above job 2's diagnosis."""
    source = REPO_ROOT / "solutions" / "session_c" / "06_debugging_lab.ipynb"
    index = next(i for i, cell in enumerate(cells(source)) if grade_id(cell) == "dbg2_diagnosis")
    assert leaks(source, index, "job_02") == ["rank == 0"]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_hint_is_folded(lab):
    for cell in cells(lab):
        if cell.cell_type != "markdown":
            continue
        hints = re.findall(r"Hint \d", cell.source)
        folded = re.findall(r"<details><summary>Hint \d</summary>", cell.source)
        assert len(hints) == len(folded), f"{lab.name}: a hint outside a <details> block:\n{cell.source[:300]}"
        assert cell.source.count("<details>") == cell.source.count("</details>")


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_answer_cells_say_nothing_about_the_answer(lab):
    for cell in cells(lab):
        if cell.metadata.get("nbgrader", {}).get("solution"):
            assert "raise NotImplementedError" in cell.source
            code = "\n".join(line for line in cell.source.splitlines() if not line.startswith(("#", "raise")))
            assert not code.strip(), f"{lab.name}: the answer cell {grade_id(cell)} holds code: {code!r}"


def test_a_diagnosis_is_checked_field_by_field():
    assert diagnosis_of({"ranks": [1, 0, 1], "function": "train", "cause": "A"}, "job_01") == ((0, 1), "train", "A")
    assert diagnosis_of({"ranks": "all", "function": "evaluate", "cause": "C"}, "job_03") == ("all", "evaluate", "C")
    for wrong, field in (({"function": "train", "cause": "A"}, "ranks"),
                         ({"ranks": 0, "function": "train", "cause": "A"}, "ranks"),
                         ({"ranks": [0], "function": "nowhere", "cause": "A"}, "function"),
                         ({"ranks": [0], "function": "train", "cause": "Z"}, "cause"),
                         ({"ranks": [True], "function": "train", "cause": "A"}, "ranks")):
        with pytest.raises(ValueError, match=field):
            diagnosis_of(wrong, "job_01")
    assert "ShardSampler" in script_names("job_04") and "ShardSampler" not in script_names("job_01")
    assert len(CAUSES) >= 12

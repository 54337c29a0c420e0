"""The grading pipeline: notebooks/ is a fresh, byte-stable release of solutions/ without solutions or
hidden tests, and autograding gives full marks to the solutions, 0 to the untouched release, and takes
away exactly the points of an exercise answered wrongly.

    .venv/bin/python -m pytest -q tests/test_grading.py

Slow (~1-2 minutes on 2 idle cores): nbgrader executes the graded notebook once per submission
(11 of them). Grading happens in scratch course directories, so the tests never write gradebook.db,
submitted/ or autograded/ into the repository.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

import grading  # scripts/ is on sys.path (tests/conftest.py)

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENT = "session_a"
GRADED = "02_model_from_scratch"
SOURCE = REPO_ROOT / "solutions" / ASSIGNMENT / f"{GRADED}.ipynb"
STUDENT_VERSION = REPO_ROOT / "notebooks" / ASSIGNMENT / f"{GRADED}.ipynb"
SOURCES = sorted((REPO_ROOT / "solutions").glob("*/*.ipynb"))

# Plausible wrong answers, each written into one exercise of an otherwise correct submission:
# name -> (solution cell, test cell that must lose its points, [(text of the solution, wrong text), ...]).
# The first wrong answer of each exercise is graded alone, which shows it costs that exercise's points
# and nothing else; the others are graded together, at most one per exercise in a submission (the
# test cells are independent: each calls only its own exercise's code, exercise 3 with the library's
# rotate_half), which keeps the number of notebook executions small.
WRONG_ANSWERS = {
    "rmsnorm_eps_outside_the_root": ("ex1_rmsnorm", "ex1_rmsnorm_tests", [
        ("torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)",
         "1 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)")]),
    "rmsnorm_subtracts_the_mean": ("ex1_rmsnorm", "ex1_rmsnorm_tests", [
        ("x32 = x.float()", "x32 = x.float() - x.float().mean(-1, keepdim=True)")]),
    "rotate_half_along_the_first_dim": ("ex2_rotate_half", "ex2_rotate_half_tests", [
        ("half = x.shape[-1] // 2", "half = x.shape[0] // 2"),
        ("x1, x2 = x[..., :half], x[..., half:]", "x1, x2 = x[:half], x[half:]"),
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((-x2, x1), dim=0)")]),
    "rotate_half_wrong_half_negated": ("ex2_rotate_half", "ex2_rotate_half_tests", [
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((x2, -x1), dim=-1)")]),
    "rope_keys_not_rotated": ("ex3_rope", "ex3_rope_tests", [
        ("k_rotated = k * cos + rotate_half(k) * sin", "k_rotated = k")]),
    "rope_cos_and_sin_swapped": ("ex3_rope", "ex3_rope_tests", [
        ("q * cos + rotate_half(q) * sin", "q * sin + rotate_half(q) * cos"),
        ("k * cos + rotate_half(k) * sin", "k * sin + rotate_half(k) * cos")]),
    "mlp_silu_on_the_up_branch": ("ex4_mlp", "ex4_mlp_tests", [
        ("F.silu(self.gate_proj(x)) * self.up_proj(x)", "self.gate_proj(x) * F.silu(self.up_proj(x))")]),
    "attention_without_sqrt_d": ("ex5_attention", "ex5_attention_tests", [
        ("(q @ k.transpose(-2, -1)) / math.sqrt(head_dim)", "q @ k.transpose(-2, -1)")]),
    "attention_without_mask": ("ex5_attention", "ex5_attention_tests", [
        ('scores = scores.masked_fill(~causal_mask, float("-inf"))', "")]),
    "attention_mask_off_by_one": ("ex5_attention", "ex5_attention_tests", [
        (".tril()", ".tril(1)")]),
    "init_residual_scale_without_the_2": ("ex6_init", "ex6_init_tests", [
        ("(2 * self.config.n_layer) ** -0.5", "self.config.n_layer ** -0.5")]),
    "loss_without_the_shift": ("ex7_forward", "ex7_forward_tests", [
        ("logits[:, :-1, :].reshape(-1, logits.size(-1))", "logits.reshape(-1, logits.size(-1))"),
        ("targets[:, 1:].reshape(-1)", "targets.reshape(-1)")]),
    "forward_without_the_final_norm": ("ex7_forward", "ex7_forward_tests", [
        ("self.lm_head(self.norm_f(x))", "self.lm_head(x)")]),
    "forward_without_checkpointing": ("ex7_forward", "ex7_forward_tests", [
        ("            if self.config.activation_checkpointing and self.training:\n"
         "                x = checkpoint(block, x, cos, sin, use_reentrant=False)\n"
         "            else:\n"
         "                x = block(x, cos, sin)",
         "            x = block(x, cos, sin)")]),
}


def grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def points(path: Path) -> dict[str, float]:
    """{test cell id: points} of a notebook's autograded cells."""
    nb = nbformat.read(path, as_version=4)
    return {grade_id(c): float(c.metadata.nbgrader["points"]) for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}


def without_markers(source: str) -> str:
    """A solution cell as a learner would write it: the solution code without nbgrader's marker lines."""
    return "\n".join(line for line in source.splitlines()
                     if not line.strip().startswith(("### BEGIN SOLUTION", "### END SOLUTION")))


def submissions_of_wrong_answers() -> dict[str, list[str]]:
    """{student: wrong answers in that submission}: first of each exercise alone, then the rest combined."""
    by_exercise: dict[str, list[str]] = {}
    for name, (solution_cell, _, _) in WRONG_ANSWERS.items():
        by_exercise.setdefault(solution_cell, []).append(name)
    students = {f"wrong-{names[0]}": [names[0]] for names in by_exercise.values()}
    for rank in range(1, max(len(names) for names in by_exercise.values())):
        students[f"wrong-combined-{rank}"] = [names[rank] for names in by_exercise.values() if len(names) > rank]
    return students


WRONG_SUBMISSIONS = submissions_of_wrong_answers()


def answered(wrong_answers: list[str]):
    """The student version with every exercise answered by the solution, except the named wrong answers."""
    solutions = {grade_id(c): c.source for c in nbformat.read(SOURCE, as_version=4).cells if grade_id(c)}
    edits = {WRONG_ANSWERS[name][0]: WRONG_ANSWERS[name][2] for name in wrong_answers}
    assert len(edits) == len(wrong_answers), f"two wrong answers for one exercise in {wrong_answers}"
    nb = nbformat.read(STUDENT_VERSION, as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            code = without_markers(solutions[grade_id(cell)])
            for right, wrong in edits.get(grade_id(cell), []):
                assert code.count(right) == 1, (
                    f"the solution of {grade_id(cell)} no longer contains {right!r} exactly once: update WRONG_ANSWERS")
                code = code.replace(right, wrong)
            cell.source = code
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Autograde the solutions, the untouched release and the wrong-answer submissions.

    The submissions are split over two scratch courses graded side by side (one nbgrader run each,
    one kernel at a time per run; the notebook's own tensors use one thread). Returns
    (scores per student, {student: {test cell id: text the cell printed}}).
    """
    submissions = {"solutions": nbformat.read(SOURCE, as_version=4),
                   "untouched": nbformat.read(STUDENT_VERSION, as_version=4)}
    submissions.update({student: answered(names) for student, names in WRONG_SUBMISSIONS.items()})
    courses = [grading.stage_course(REPO_ROOT, tmp_path_factory.mktemp("course"), [ASSIGNMENT]) for _ in range(2)]
    course_of = {student: courses[i % len(courses)] for i, student in enumerate(submissions)}
    for student, nb in submissions.items():
        path = course_of[student] / "submitted" / student / ASSIGNMENT / f"{GRADED}.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(nb, path)
    with ThreadPoolExecutor(len(courses)) as pool:
        scores = {}
        for part in pool.map(lambda course: grading.autograde(course, ASSIGNMENT), courses):
            scores.update(part)
    printed = {}
    for student, course in course_of.items():
        nb = nbformat.read(course / "autograded" / student / ASSIGNMENT / f"{GRADED}.ipynb", as_version=4)
        # Printed text only: a traceback quotes the test's source, including its success messages.
        printed[student] = {grade_id(c): "".join(o.text for o in c.outputs if o.output_type == "stream")
                            for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    return scores, printed


def cell_scores(graded, student: str) -> dict[str, tuple[float, float]]:
    return graded[0][student][ASSIGNMENT][GRADED]


# ------------------------------------------------------------------ release

@pytest.fixture(scope="module")
def fresh_release(tmp_path_factory):
    """A release of the repository's solutions/ built in a scratch folder."""
    fresh = tmp_path_factory.mktemp("fresh-release")
    grading.build_release(REPO_ROOT, fresh)
    return fresh


def test_release_is_not_stale(fresh_release):
    stale = grading.compare_release(fresh_release, REPO_ROOT)
    assert not stale, f"notebooks/ is stale, run `python scripts/grading.py release` and commit: {stale}"


def test_stale_and_orphan_notebooks_are_reported(fresh_release, tmp_path):
    shutil.copytree(REPO_ROOT / "solutions", tmp_path / "solutions")
    shutil.copytree(fresh_release, tmp_path / "notebooks")
    assert grading.compare_release(fresh_release, tmp_path) == []
    edited = tmp_path / "notebooks" / ASSIGNMENT / f"{GRADED}.ipynb"
    edited.write_text(edited.read_text().replace("raise NotImplementedError()", "pass", 1))
    shutil.copyfile(edited, tmp_path / "notebooks" / ASSIGNMENT / "99_no_source.ipynb")
    assert grading.compare_release(fresh_release, tmp_path) == [
        f"notebooks/{ASSIGNMENT}/{GRADED}.ipynb", f"notebooks/{ASSIGNMENT}/99_no_source.ipynb"]


def test_release_twice_gives_identical_files(fresh_release, tmp_path):
    assert {p.relative_to(fresh_release) for p in fresh_release.rglob("*.ipynb")} == \
        {s.relative_to(REPO_ROOT / "solutions") for s in SOURCES}
    shutil.copytree(fresh_release, tmp_path, dirs_exist_ok=True)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert grading.release(REPO_ROOT, tmp_path) == [], "releasing again changed files"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_release_contains_no_solution_and_no_hidden_test(source):
    released = REPO_ROOT / "notebooks" / source.relative_to(REPO_ROOT / "solutions")
    assert released.is_file(), f"{released} is missing: run `python scripts/grading.py release`"
    source_cells = nbformat.read(source, as_version=4).cells
    release_cells = nbformat.read(released, as_version=4).cells
    release_lines = {line.strip() for cell in release_cells for line in cell.source.splitlines()}
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert not any(marker in cell.source for cell in release_cells), f"{released}: contains '### {marker}'"
    # Lines that exist only inside solution / hidden-test regions must not reach the release.
    secret, public = set(), set()
    for cell in source_cells:
        inside = False
        for line in cell.source.splitlines():
            if line.strip().startswith(("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS")):
                inside = True
            elif line.strip().startswith(("### END SOLUTION", "### END HIDDEN TESTS")):
                inside = False
            else:
                (secret if inside else public).add(line.strip())
    leaked = sorted(line for line in (secret - public) & release_lines if line and not line.startswith("#"))
    assert not leaked, f"{released}: solution or hidden-test lines leaked: {leaked}"
    for cell in release_cells:
        if cell.metadata.get("nbgrader", {}).get("solution") and cell.cell_type == "code":
            assert "raise NotImplementedError()" in cell.source, f"{released}, {grade_id(cell)}: no code stub"


# ------------------------------------------------------------------ autograde

def test_solutions_score_full_marks(graded):
    expected = points(SOURCE)
    got = cell_scores(graded, "solutions")
    assert set(got) == set(expected), f"graded cells {sorted(got)} != test cells of the notebook {sorted(expected)}"
    lost = {cell: score for cell, score in got.items() if score != (expected[cell], expected[cell])}
    assert not lost, f"the solutions lose points: {lost}\n{ {c: graded[1]['solutions'][c] for c in lost} }"


def test_untouched_release_scores_zero_on_every_graded_cell(graded):
    got = cell_scores(graded, "untouched")
    assert set(got) == set(points(SOURCE))
    assert all(max_score > 0 for _, max_score in got.values())
    assert {cell: score for cell, (score, _) in got.items() if score != 0} == {}


@pytest.mark.parametrize("name", list(WRONG_ANSWERS))
def test_wrong_answer_loses_exactly_its_exercise(graded, name):
    student = next(s for s, names in WRONG_SUBMISSIONS.items() if name in names)
    wrong_cells = {WRONG_ANSWERS[n][1] for n in WRONG_SUBMISSIONS[student]}
    test_cell = WRONG_ANSWERS[name][1]
    expected = points(SOURCE)
    got = cell_scores(graded, student)
    assert got[test_cell] == (0.0, expected[test_cell]), \
        f"{name}: {test_cell} should score 0, got {got[test_cell]}; it printed:\n{graded[1][student][test_cell]}"
    others = {cell: score for cell, score in got.items() if cell not in wrong_cells and score != (expected[cell], expected[cell])}
    assert not others, f"{name}: exercises answered correctly lost points too: {others}"


def test_every_exercise_has_a_wrong_answer_graded_alone():
    alone = {WRONG_ANSWERS[names[0]][1] for names in WRONG_SUBMISSIONS.values() if len(names) == 1}
    assert alone == set(points(SOURCE))


def test_hidden_tests_of_every_exercise_catch_a_wrong_answer_the_visible_tests_miss(graded):
    """For each exercise, some wrong answer passes the visible tests and is caught only by the hidden ones."""
    caught_by_hidden = set()
    for student, names in WRONG_SUBMISSIONS.items():
        for name in names:
            test_cell = WRONG_ANSWERS[name][1]
            printed = graded[1][student][test_cell]
            if "visible tests passed" in printed and "hidden tests passed" not in printed:
                caught_by_hidden.add(test_cell)
    missing = sorted(set(points(SOURCE)) - caught_by_hidden)
    assert not missing, f"no wrong answer is caught by the hidden tests alone for: {missing}"


def test_score_table(graded):
    table = grading.format_scores({"solutions": graded[0]["solutions"]})
    rows = [line.split() for line in table.splitlines()]
    total = f"{sum(points(SOURCE).values()):g}"
    assert ["solutions", ASSIGNMENT, GRADED, "TOTAL", total, "/", total] in rows, table
    assert {row[3] for row in rows[1:]} == set(points(SOURCE)) | {"TOTAL"}, table

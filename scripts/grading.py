"""Release and grade the course's exercises with nbgrader.

    python scripts/grading.py release          # solutions/ -> notebooks/ (the student versions; make release)
    python scripts/grading.py check-stale      # exit 1 and list every notebook that differs from a fresh release
    python scripts/grading.py autograde        # grade submitted/<student>/<assignment>/*.ipynb (make autograde)
    python scripts/grading.py autograde --assignment session_a --student alice --feedback
    python scripts/grading.py check-solutions  # grade every instructor notebook as a submission: score and seconds

solutions/<assignment>/*.ipynb are the instructor notebooks and the only notebooks edited by hand;
notebooks/<assignment>/ is generated from them by `nbgrader generate_assignment` and committed.
A release is built in a scratch course directory and normalised (volatile metadata removed), so
generating it twice gives the same bytes and `check-stale` can compare it with notebooks/.

Autograding writes autograded/ (and feedback/ with --feedback) and keeps the gradebook in
gradebook.db, all at the repository root; it prints one score per student, notebook and graded cell.
nbgrader runs as `<this python> -m nbgrader`, so the notebooks' `python3` kernel is this interpreter,
the one where course_lib is installed (another interpreter would fail every test and score 0).
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parent.parent
# These mirror nbgrader_config.py (CourseDirectory.source_directory / release_directory / ...).
SOURCE_DIR = "solutions"
RELEASE_DIR = "notebooks"
SUBMITTED_DIR = "submitted"
CONFIG_FILE = "nbgrader_config.py"
# Never copied into a scratch course: editor state and whatever a notebook run leaves behind.
IGNORED = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.pyc", "runs", "logs")

# Metadata that records an editor session or an execution rather than the notebook itself.
VOLATILE_NOTEBOOK_METADATA = ("widgets", "papermill", "vscode", "toc", "varInspector", "celltoolbar")
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "papermill", "collapsed", "scrolled", "trusted")

Scores = dict[str, dict[str, dict[str, dict[str, tuple[float, float]]]]]
"""student -> assignment -> notebook -> graded cell id -> (score, max_score)."""


# ------------------------------------------------------------------ running nbgrader

def nbgrader_env() -> dict[str, str]:
    env = dict(os.environ)
    # nbgrader shells out to `alembic` (its database migrations), found on PATH next to this python.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # Test cells work on tiny tensors; with several threads per kernel on a busy machine, thread
    # contention makes each small op ~100x slower. One thread per kernel, unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # silences a debugger warning in every kernel
    return env


def run_nbgrader(course_root: Path, *args: str) -> str:
    """Run `python -m nbgrader ARGS` in course_root (nbgrader reads nbgrader_config.py from the cwd)."""
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course_root, env=nbgrader_env(),
                            capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"`nbgrader {' '.join(args)}` failed in {course_root} (exit {result.returncode}):\n{output}")
    return output


def each_assignment(root: Path, ids: list[str]) -> list[str]:
    """The assignment arguments of nbgrader commands over `ids`: ["*"] when they are every assignment of the
    course at root (one nbgrader process for all, instead of one start-up of several seconds per assignment),
    else the ids themselves."""
    return ["*"] if len(ids) > 1 and sorted(ids) == assignments(root) else list(ids)


def assignments(root: Path = REPO_ROOT) -> list[str]:
    """Assignment ids: the folders of solutions/ that hold at least one notebook."""
    source = Path(root) / SOURCE_DIR
    return sorted(p.name for p in source.iterdir() if p.is_dir() and any(p.glob("*.ipynb"))) if source.is_dir() else []


def stage_course(root: Path, dest: Path, assignment_ids: list[str] | None = None) -> Path:
    """Copy nbgrader_config.py and solutions/<assignment>/ of root into a scratch course directory dest."""
    root, dest = Path(root), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / CONFIG_FILE, dest / CONFIG_FILE)
    for assignment in assignment_ids or assignments(root):
        shutil.copytree(root / SOURCE_DIR / assignment, dest / SOURCE_DIR / assignment, ignore=IGNORED,
                        dirs_exist_ok=True)
    return dest


# ------------------------------------------------------------------ release

def normalise_notebook(path: Path) -> None:
    """Rewrite a generated notebook without volatile metadata, in nbformat's canonical layout."""
    nb = nbformat.read(path, as_version=4)
    for key in VOLATILE_NOTEBOOK_METADATA:
        nb.metadata.pop(key, None)
    if "language_info" in nb.metadata:  # the source's Python version is not part of the release
        nb.metadata.language_info = {"name": nb.metadata.language_info.get("name", "python")}
    heading = "this exercise"
    for cell in nb.cells:
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "markdown":
            heading = next((line.lstrip("#").strip() for line in cell.source.splitlines() if line.startswith("## ")),
                           heading)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if cell.metadata.get("nbgrader", {}).get("solution"):
                cell.source = cell.source.replace("raise NotImplementedError()", _stub(heading))
    nbformat.validate(nb)
    nbformat.write(nb, path)


def _stub(heading: str) -> str:
    """The line a learner replaces: its error names the exercise and says what to do."""
    title = re.sub(r"\s*\(\d+ points?\)$", "", heading).replace('"', "'")
    return f'raise NotImplementedError("{title}: replace this line with your code, then run the test cell below")'


def build_release(root: Path, dest: Path) -> list[Path]:
    """Generate the student version of every assignment of root into dest/<assignment>/ (a fresh folder).

    Runs nbgrader in a scratch course directory, so neither root's gradebook nor notebooks/ is touched.
    Returns the files written, relative to dest.
    """
    root, dest = Path(root), Path(dest)
    ids = assignments(root)
    if not ids:
        raise FileNotFoundError(f"no assignment folders with notebooks under {root / SOURCE_DIR}")
    with tempfile.TemporaryDirectory(prefix="release-") as scratch:
        course = stage_course(root, Path(scratch) / "course", ids)
        for assignment in each_assignment(course, ids):
            run_nbgrader(course, "generate_assignment", assignment, "--force")
        generated = course / RELEASE_DIR
        for notebook in generated.rglob("*.ipynb"):
            normalise_notebook(notebook)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(generated, dest, dirs_exist_ok=True)
        return sorted(p.relative_to(generated) for p in generated.rglob("*") if p.is_file())


RELEASED = ".released.json"
"""In notebooks/: the sha256 of every file release wrote, to tell its own files from a learner's edits."""


class ReleaseRefused(RuntimeError):
    """release would overwrite or delete student notebooks that were edited after it wrote them."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edited_since_release(out_dir: Path, paths) -> list[Path]:
    """Those of `paths` (existing files in out_dir) whose bytes are not what release last wrote there."""
    try:
        written = json.loads((out_dir / RELEASED).read_text())
    except (OSError, ValueError):
        written = {}
    return [p for p in paths if p.is_file() and written.get(p.relative_to(out_dir).as_posix()) != _sha256(p)]


def release(root: Path = REPO_ROOT, out_dir: Path | None = None, force: bool = False) -> list[Path]:
    """Regenerate out_dir (default root/notebooks) from root/solutions; returns the files that changed.

    Files are rewritten only when their bytes change; a notebook whose source was deleted is removed.
    Other files in out_dir (a learner's runs/, say) are left alone. A notebook edited after release wrote it
    (a learner's answers, or just outputs saved by JupyterLab) is never overwritten or deleted silently:
    ReleaseRefused names it, unless force. out_dir/.released.json records what release wrote.
    """
    root = Path(root)
    out_dir = Path(out_dir) if out_dir is not None else root / RELEASE_DIR
    changed = []
    with tempfile.TemporaryDirectory(prefix="release-") as fresh:
        files = build_release(root, Path(fresh))
        to_write = [rel for rel in files if not (out_dir / rel).is_file()
                    or not filecmp.cmp(Path(fresh) / rel, out_dir / rel, shallow=False)]
        orphans = _orphan_notebooks(root, out_dir)
        edited = edited_since_release(out_dir, [out_dir / rel for rel in to_write] + orphans)
        if edited and not force:
            raise ReleaseRefused(
                "release would overwrite or delete notebooks that were changed since it wrote them (a learner's "
                "work?):\n" + "\n".join(f"  {p}" for p in edited) + "\nNothing was written. Work in the "
                "workspace that `make lab` creates (workspace/, which release never touches); copy these files "
                "there first if they hold work to keep. To overwrite them anyway: python scripts/grading.py "
                "release --force")
        for rel in to_write:
            target = out_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(fresh) / rel, target)
            changed.append(target)
        for orphan in orphans:
            orphan.unlink()
            changed.append(orphan)
        record = {rel.as_posix(): _sha256(out_dir / rel) for rel in files}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RELEASED).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return changed


def _orphan_notebooks(root: Path, out_dir: Path) -> list[Path]:
    """Notebooks in out_dir/<assignment>/ with no counterpart in solutions/<assignment>/."""
    return sorted(nb for nb in out_dir.glob("*/*.ipynb")
                  if not (root / SOURCE_DIR / nb.parent.name / nb.name).is_file())


def compare_release(fresh: Path, root: Path = REPO_ROOT) -> list[str]:
    """Files of root/notebooks that differ from the release tree `fresh` (missing, changed, or without a source)."""
    fresh, root = Path(fresh), Path(root)
    released = root / RELEASE_DIR
    stale = [f"{RELEASE_DIR}/{rel.relative_to(fresh)}" for rel in sorted(fresh.rglob("*")) if rel.is_file()
             and not ((released / rel.relative_to(fresh)).is_file()
                      and filecmp.cmp(rel, released / rel.relative_to(fresh), shallow=False))]
    if released.is_dir():
        stale += [str(nb.relative_to(root)) for nb in _orphan_notebooks(root, released)]
    record = {rel.relative_to(fresh).as_posix(): _sha256(rel) for rel in fresh.rglob("*") if rel.is_file()}
    if (released / RELEASED).exists():  # a copy of a release without its record has nothing to compare
        try:
            up_to_date = json.loads((released / RELEASED).read_text()) == record
        except ValueError:
            up_to_date = False
        if not up_to_date:
            stale.append(f"{RELEASE_DIR}/{RELEASED}")
    return sorted(stale)


def stale_notebooks(root: Path = REPO_ROOT) -> list[str]:
    """Regenerate the release into a scratch folder and compare it with root/notebooks (see compare_release)."""
    with tempfile.TemporaryDirectory(prefix="release-") as fresh:
        build_release(root, Path(fresh))
        return compare_release(Path(fresh), root)


# ------------------------------------------------------------------ autograde

def autograde(root: Path = REPO_ROOT, assignment: str | None = None, student: str | None = None,
              feedback: bool = False) -> Scores:
    """Grade root/submitted/<student>/<assignment>/ with nbgrader; returns the scores of every graded cell.

    The gradebook (root/gradebook.db) is first brought up to date with solutions/ (the hidden tests are
    stored there when an assignment is generated), into a scratch release folder so notebooks/ is untouched.
    """
    root = Path(root)
    submitted = root / SUBMITTED_DIR
    found = sorted({p.name for p in submitted.glob("*/*") if p.is_dir()}) if submitted.is_dir() else []
    ids = [assignment] if assignment else found
    if not any(any(submitted.glob(f"{student or '*'}/{a}")) for a in ids):
        raise FileNotFoundError(
            f"nothing to grade: put each submission in {submitted}/<student>/<assignment>/*.ipynb "
            f"(assignments: {', '.join(assignments(root)) or 'none under ' + SOURCE_DIR + '/'})")
    for a in ids:
        if not (root / SOURCE_DIR / a).is_dir():
            raise FileNotFoundError(f"submissions for assignment {a!r} but no {SOURCE_DIR}/{a}/ to grade them against")
    student_args = [f"--student={student}"] if student else []
    with tempfile.TemporaryDirectory(prefix="gradebook-release-") as scratch:
        for a in each_assignment(root, ids):
            run_nbgrader(root, "generate_assignment", a, "--force", f"--CourseDirectory.release_directory={scratch}")
    for a in each_assignment(root, ids):
        run_nbgrader(root, "autograde", a, "--force", *student_args)
        if feedback:
            run_nbgrader(root, "generate_feedback", a, "--force", *student_args)
    if feedback:
        offline_feedback(root / "feedback")
    return read_scores(root, ids, student)


MATHJAX_SOURCE = REPO_ROOT / "book" / "_static" / "mathjax"
FEEDBACK_MATHJAX = "_mathjax"
_CDN_MATHJAX = re.compile(r'<script src="https://cdn[^"]*mathjax[^"]*">\s*</script>\s*'
                          r'(<!-- MathJax configuration -->\s*)?<script type="text/x-mathjax-config">.*?</script>',
                          re.S | re.I)


def offline_feedback(feedback_dir: Path) -> list[Path]:
    """Make nbgrader's feedback pages render their formulas offline: the MathJax 2 that nbconvert's template
    loads from a CDN is replaced by the course's vendored MathJax 3, copied once into feedback/_mathjax/.
    Returns the pages rewritten."""
    feedback_dir = Path(feedback_dir)
    pages = sorted(feedback_dir.glob("*/*/*.html"))
    if not pages:
        return []
    if not (feedback_dir / FEEDBACK_MATHJAX / "tex-chtml.js").is_file():
        shutil.copytree(MATHJAX_SOURCE, feedback_dir / FEEDBACK_MATHJAX, dirs_exist_ok=True)
    local = (f'<script>window.MathJax = {{tex: {{inlineMath: [["$", "$"], ["\\\\(", "\\\\)"]], '
             f'displayMath: [["$$", "$$"], ["\\\\[", "\\\\]"]], processEscapes: true}}}};</script>\n'
             f'<script src="../../{FEEDBACK_MATHJAX}/tex-chtml.js"></script>')
    rewritten = []
    for page in pages:
        html = page.read_text(encoding="utf-8")
        new = _CDN_MATHJAX.sub(lambda _: local, html, count=1)
        if new != html:
            page.write_text(new, encoding="utf-8")
            rewritten.append(page)
    return rewritten


def read_scores(root: Path, assignment_ids: list[str], student: str | None = None) -> Scores:
    """Scores recorded in root/gradebook.db for the given assignments (and one student, if given)."""
    from nbgrader.api import Gradebook, MissingEntry

    scores: Scores = {}
    with Gradebook(f"sqlite:///{Path(root).resolve() / 'gradebook.db'}") as gradebook:
        for a in assignment_ids:
            try:
                submissions = gradebook.find_assignment(a).submissions
            except MissingEntry:
                continue
            for submission in submissions:
                if student and submission.student.id != student:
                    continue
                per_notebook = scores.setdefault(submission.student.id, {}).setdefault(a, {})
                for notebook in submission.notebooks:
                    per_notebook[notebook.name] = {g.name: (float(g.score), float(g.max_score)) for g in notebook.grades}
    return scores


def autograde_notebook(path: Path, assignment: str, root: Path = REPO_ROOT) -> dict[str, tuple[float, float]]:
    """Grade one notebook as a submission of `assignment`, in a scratch course; {cell id: (score, max)}."""
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="autograde-") as scratch:
        course = stage_course(root, Path(scratch), [assignment])
        target = course / SUBMITTED_DIR / "student" / assignment / path.name
        target.parent.mkdir(parents=True)
        shutil.copyfile(path, target)
        return autograde(course, assignment, "student")["student"][assignment][path.stem]


def check_solutions(root: Path = REPO_ROOT) -> list[tuple[str, float, float, float]]:
    """Autograde each graded instructor notebook as a submission of its own assignment, one at a time.

    Returns [(assignment/notebook, score, max score, seconds)]: the solutions must score full marks, and the
    seconds are what grading one learner's notebook takes on this machine.
    """
    rows = []
    for source in sorted((Path(root) / SOURCE_DIR).glob("*/*.ipynb")):
        nb = nbformat.read(source, as_version=4)
        if not any(cell.metadata.get("nbgrader", {}).get("grade") for cell in nb.cells):
            continue
        start = time.perf_counter()
        cells = autograde_notebook(source, source.parent.name, root)
        rows.append((f"{source.parent.name}/{source.stem}", sum(s for s, _ in cells.values()),
                     sum(m for _, m in cells.values()), time.perf_counter() - start))
    return rows


def format_scores(scores: Scores) -> str:
    """One line per graded cell and a total per notebook."""
    rows = [("student", "assignment", "notebook", "cell", "score")]
    for student, by_assignment in sorted(scores.items()):
        for a, by_notebook in sorted(by_assignment.items()):
            for notebook, cells in sorted(by_notebook.items()):
                if not cells:
                    continue  # a notebook without graded cells (a lesson)
                for cell, (score, max_score) in sorted(cells.items()):
                    rows.append((student, a, notebook, cell, f"{score:g} / {max_score:g}"))
                total = sum(s for s, _ in cells.values()), sum(m for _, m in cells.values())
                rows.append((student, a, notebook, "TOTAL", f"{total[0]:g} / {total[1]:g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip() for row in rows)


# ------------------------------------------------------------------ notebook text helpers

def marked_regions(source: str, marker: str) -> list[list[str]]:
    """Lines between `### BEGIN <marker>` and `### END <marker>` (e.g. marker='SOLUTION', 'HIDDEN TESTS').

    Raises ValueError when the markers are unbalanced or nested.
    """
    begin, end = re.compile(rf"^\s*###\s*BEGIN {marker}\s*$"), re.compile(rf"^\s*###\s*END {marker}\s*$")
    regions, current = [], None
    for number, line in enumerate(source.splitlines(), start=1):
        if begin.match(line):
            if current is not None:
                raise ValueError(f"line {number}: BEGIN {marker} inside an open {marker} region")
            current = []
        elif end.match(line):
            if current is None:
                raise ValueError(f"line {number}: END {marker} without a BEGIN {marker}")
            regions.append(current)
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        raise ValueError(f"BEGIN {marker} without an END {marker}")
    return regions


def parameter_names(nb) -> set[str]:
    """Names assigned in a notebook's cell tagged `parameters` (the papermill parameters)."""
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    if not cells:
        return set()
    body = ast.parse(cells[0].source).body
    return {target.id for node in body if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)}


# ------------------------------------------------------------------ command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="course directory holding nbgrader_config.py and solutions/ (default: this repository)")
    commands = parser.add_subparsers(dest="command", required=True)
    rel = commands.add_parser("release", help="regenerate notebooks/ from solutions/")
    rel.add_argument("--out-dir", type=Path, default=None, help="write here instead of notebooks/")
    rel.add_argument("--force", action="store_true",
                     help="overwrite student notebooks even if they were edited since the last release")
    commands.add_parser("check-stale", help="exit 1 if notebooks/ differs from a fresh release")
    commands.add_parser("check-solutions", help="autograde every instructor notebook: score and seconds each")
    grade = commands.add_parser("autograde", help="grade submitted/<student>/<assignment>/")
    grade.add_argument("--assignment", default=None, help="one assignment id (default: every submitted one)")
    grade.add_argument("--student", default=None, help="one student id (default: every student)")
    grade.add_argument("--feedback", action="store_true", help="also write HTML feedback into feedback/")
    args = parser.parse_args(argv)

    root = args.root.resolve()
    if args.command == "release":
        try:
            changed = release(root, args.out_dir, force=args.force)
        except ReleaseRefused as refused:
            print(refused, file=sys.stderr)
            return 1
        where = args.out_dir or root / RELEASE_DIR
        print(f"released {', '.join(assignments(root))} into {where}: "
              + (f"{len(changed)} file(s) changed" if changed else "already up to date"))
        for path in changed:
            print(f"  {path}")
        return 0
    if args.command == "check-stale":
        stale = stale_notebooks(root)
        if stale:
            print("stale: these files differ from `python scripts/grading.py release` (run it, then commit):")
            print("\n".join(f"  {path}" for path in stale))
            return 1
        print(f"{RELEASE_DIR}/ matches a fresh release of {SOURCE_DIR}/")
        return 0
    if args.command == "check-solutions":
        rows = check_solutions(root)
        width = max(len(name) for name, *_ in rows)
        for name, score, max_score, seconds in rows:
            print(f"{name:<{width}}  {score:g} / {max_score:g}  graded in {seconds:5.1f} s")
        print(f"{sum(r[1] for r in rows):g} / {sum(r[2] for r in rows):g} points in {len(rows)} graded notebooks")
        return 0 if all(score == max_score for _, score, max_score, _ in rows) else 1
    try:
        scores = autograde(root, args.assignment, args.student, args.feedback)
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        return 1
    print(format_scores(scores))
    print(f"autograded notebooks: {root / 'autograded'}" + (f"; feedback: {root / 'feedback'}" if args.feedback else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

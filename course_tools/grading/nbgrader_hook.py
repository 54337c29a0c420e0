"""nbgrader's autograde step, run in the grading sandbox instead of the learner's kernel.

nbgrader_config.py puts `GradeInSandbox` in place of nbgrader's `Execute` in `Autograde.autograde_preprocessors`.
nbgrader has already replaced every read-only cell and test cell of the submission with the instructor's
version; this step then grades each test cell with course_tools.grading.sandbox.grade (the learner's answer
cells only, in a fresh process, after an audit) and writes what the check printed into the test cell,
followed by an error output when it failed. nbgrader's SaveAutoGrades reads those outputs as usual: an
error scores 0, a clean cell its points. The notebook's other cells are not executed while grading.
"""

from __future__ import annotations

from pathlib import Path

from nbformat.v4 import new_output
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Float, Unicode

from course_tools.grading.exercises import answers_in, nbgrader_metadata
from course_tools.grading.sandbox import DEFAULT_TIMEOUT_S, grade


class GradeInSandbox(NbGraderPreprocessor):
    """Grade every autograded test cell of a submission in the sandbox (see course_tools.grading.sandbox)."""

    source_directory = Unicode("solutions", help="Folder of the instructor notebooks, relative to the course "
                               "root (nbgrader's CourseDirectory.source_directory)").tag(config=True)
    timeout = Float(DEFAULT_TIMEOUT_S, help="Seconds one exercise's check may run").tag(config=True)

    def preprocess(self, nb, resources):
        info = resources["nbgrader"]
        source = Path(self.source_directory) / info["assignment"] / f"{info['notebook']}.ipynb"
        tests = [cell for cell in nb.cells
                 if cell.cell_type == "code" and nbgrader_metadata(cell).get("grade")
                 and not nbgrader_metadata(cell).get("solution")]
        if not tests:
            return nb, resources
        if not source.is_file():
            raise FileNotFoundError(f"cannot grade {info['notebook']}: the instructor notebook {source.resolve()} "
                                    "is missing")
        results = grade(source, {"submission": answers_in(nb)}, timeout_s=self.timeout)["submission"]
        for cell in tests:
            result = results[nbgrader_metadata(cell)["grade_id"]]
            cell.outputs = [new_output("stream", name="stdout", text=result.output)] if result.output else []
            if not result.passed:
                lines = result.error.rstrip().splitlines() or ["the check failed"]
                name, _, value = lines[-1].partition(":")
                cell.outputs.append(new_output("error", ename=name.strip() or "CheckFailed",
                                               evalue=value.strip(), traceback=lines))
            self.log.info("%s: %s in %.1f s", nbgrader_metadata(cell)["grade_id"],
                          "passed" if result.passed else "failed", result.seconds)
        return nb, resources

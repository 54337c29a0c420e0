"""nbgrader configuration for the course (read by every `nbgrader` command run from the repo root).

solutions/<assignment>/*.ipynb are the instructor notebooks (nbgrader's "source" step);
notebooks/<assignment>/*.ipynb are the student versions it generates (the "release" step).
Use the wrappers rather than calling nbgrader directly:

    python scripts/grading.py release        # solutions/ -> notebooks/ (make release)
    python scripts/grading.py check-stale    # exit 1 if notebooks/ is out of date
    python scripts/grading.py autograde      # grade submitted/<student>/<assignment>/*.ipynb (make autograde)
"""

c = get_config()  # noqa: F821 (injected by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "distributed-llm-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "notebooks"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
# Outputs a notebook may leave next to itself must never be copied into a release or a submission.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "runs", "logs"]

# What a learner sees in place of a solution region (nbgrader's default, spelled out).
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Interpreter: the grading sandbox runs with the interpreter that runs nbgrader, so run it as
# `.venv/bin/python -m nbgrader` (scripts/grading.py does): course_lib must be importable there.

# Autograding runs each exercise's tests on the learner's answer cells in a fresh process, after an audit
# of the answer (course_tools/grading/), instead of executing the submission in the learner's kernel: what a
# learner's cell does to a kernel (rebinding the checks, AST transformers) cannot reach the tests there.
from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, IgnorePattern,  # noqa: E402
                                    LimitOutput, SaveAutoGrades)

from course_tools.grading.nbgrader_hook import GradeInSandbox  # noqa: E402

c.Autograde.autograde_preprocessors = [GradeInSandbox, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
                                       SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
c.GradeInSandbox.source_directory = c.CourseDirectory.source_directory
# An exercise's check runs in seconds (those that start ranks too); one that takes minutes is stuck, not slow.
c.GradeInSandbox.timeout = 150

# Feedback pages show each test cell and what it printed, but not the hidden tests' code (nbgrader shows them by
# default): a learner reads the failing check's message and may resubmit; the hidden checks stay hidden.
# scripts/grading.py then serves the pages' MathJax from the course's vendored copy, so formulas render offline.
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor  # noqa: E402
from nbgrader.preprocessors import ClearHiddenTests, GetGrades  # noqa: E402

c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, CSSHTMLHeaderPreprocessor]

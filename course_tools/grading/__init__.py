"""Grading learners' answers soundly: each exercise's tests run on the learner's answer in a fresh
process, after an audit of the answer's code, with the setup and the tests taken from the instructor's
notebook (sandbox.py explains why and how; audit.py lists what an answer may not do).

    from course_tools.grading import grade, answers_in
    results = grade("solutions/session_a/02_model_from_scratch.ipynb", {"alice": answers_in(notebook)})

nbgrader uses it through `course_tools.grading.nbgrader_hook.GradeInSandbox`, the autograde step that
nbgrader_config.py puts in place of nbgrader's in-kernel execution.
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "sandbox": ("grade", "CheckResult"),
    "exercises": ("read_exercises", "answers_in", "without_markers"),
    "audit": ("audit", "Violation"),
})

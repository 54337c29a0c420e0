"""Debugging distributed jobs: a realistic training job, the lab's versions of it with one bug each, and the
tools to run them on real ranks and read what they leave behind (logs, stacks of hung ranks, debug reports,
parameter checksums, collective counts).

    from course_lib.debugging import run_job
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "checks": ("CAUSES", "assert_fixed", "assert_replicas_agree", "assert_windows_shared_out", "diagnosis_of"),
    "jobs": ("JOBS", "script_of"),
    "run": ("JobRun", "run_job", "one_process", "counting_collectives", "DDP_BUCKETS"),
})

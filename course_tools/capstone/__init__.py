"""The capstone, "bring your own script": a learner's single-GPU training script, made distributed, checked the
way a cluster runs it (harness.py: 1 and 2 ranks under torchrun, equal losses, per-rank logs, one checkpoint
writer, set_epoch, a clean exit on SIGTERM and an exact resume; probe.py: what each rank is seen doing).

    python -m course_tools.capstone my_train.py -- --max_steps {steps} --out_dir {out_dir} --log_dir {log_dir} ...

book/capstone.md is the learner's checklist.
"""

from course_lib import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "harness": ("Harness", "Result", "Check", "Run"),
})

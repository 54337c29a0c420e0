"""Rank workers that grade the pipeline exercise (Session E, notebook 02b): the learner's 1F1B schedule
running course_lib's pipeline (PipelineRunner) on real ranks.

    ranks = launch(check_schedule_on_ranks, 2, args=(spawnable(one_f_one_b),))
"""

from __future__ import annotations

from unittest import mock

from course_lib.pipeline_parallel import schedules
from course_lib.pipeline_parallel.workers import pipeline_train


def check_schedule_on_ranks(schedule_fn, *, micro_batches: int = 4, steps: int = 2, seed: int = 0) -> dict:
    """Worker: train this rank's stage with schedule_fn as the '1f1b' schedule (pipeline_train, scratch runner)."""
    with mock.patch.dict(schedules.SCHEDULES, {"1f1b": schedule_fn}):
        return pipeline_train(schedule="1f1b", steps=steps, micro_batches=micro_batches, seed=seed,
                              implementation="scratch")

"""torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on our hand-cut stages equals one process.

    .venv/bin/python -m pytest -q tests/pipeline_parallel/test_torch_pipelining.py
"""

import pytest
import torch
from pipeline_parallel.test_stage import assert_matches_reference  # tests/ is on sys.path (conftest.py)

from course_lib.core.model import GPT, GPTConfig
from course_lib.pipeline_parallel.stage import GPTStage
from course_lib.pipeline_parallel.torch_pipelining import build_torch_pipeline
from course_lib.pipeline_parallel.workers import pipeline_train, reference_run
from course_lib.runtime.launch import launch, run_each

RUNS = (("torch", "gpipe"), ("torch", "1f1b"), ("scratch", "1f1b"))


@pytest.mark.distributed
def test_torch_pipelining_equals_one_process_and_scratch(tmp_path):
    settings = dict(steps=3, preset="tiny", global_batch=8, seq_len=32)
    runs = {f"{impl} {schedule}": (pipeline_train, dict(schedule=schedule, implementation=impl, micro_batches=4,
                                                         **settings)) for impl, schedule in RUNS}
    ranks = launch(run_each, 2, args=(runs,), log_dir=tmp_path, echo=False, threads_per_rank=1)
    reference = reference_run(**settings)
    for impl, schedule in RUNS:
        assert_matches_reference(ranks, reference, f"{impl} {schedule}")
    for name, param in ranks[0]["torch 1f1b"]["params"].items():  # both implementations, same steps
        torch.testing.assert_close(param, ranks[0]["scratch 1f1b"]["params"][name])
    assert ranks[-1]["torch gpipe"]["tied_grad_bytes"][0] == 256 * 64 * 4  # the tie is ours to reduce


def test_bad_torch_schedule_is_named():
    stage = GPTStage(GPT(GPTConfig.from_preset("tiny")), 0, 1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_torch_pipeline(stage, "interleaved", 4)

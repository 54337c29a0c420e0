"""The debugging lab's jobs: the correct job equals one process; every other job shows its symptom on real ranks,
and the functions of the correct job put right (checked against one process)."""

from __future__ import annotations

import difflib
import inspect

import pytest
import torch

from course_lib.debugging import train_job
from course_lib.debugging.jobs import BASE_SOURCE, JOBS, script_of
from course_lib.debugging.run import DDP_BUCKETS, import_script, one_process, run_job
from course_lib.runtime.launch import START_METHOD_VARIABLE

pytestmark = pytest.mark.distributed

TIMEOUT_S = 10  # a correct run never waits this long; a hang costs HANG_TIMEOUT_S
HANG_TIMEOUT_S = 2


@pytest.fixture(autouse=True)
def forked_ranks(monkeypatch):
    """Ranks forked from this process start in milliseconds (the grading sandbox does the same)."""
    monkeypatch.setenv(START_METHOD_VARIABLE, "fork")


def changed_lines(name: str) -> int:
    diff = difflib.unified_diff(BASE_SOURCE.splitlines(), script_of(name).splitlines(), n=0, lineterm="")
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_job_is_the_base_script_with_a_few_lines_changed(name):
    compile(script_of(name), name, "exec")
    assert 1 <= changed_lines(name) <= 40


def test_an_unknown_job_is_named():
    with pytest.raises(KeyError, match="job_99"):
        script_of("job_99")


def assert_equals_one_process(run, reference, what: str):
    """Every rank's losses, gradient norms and final parameters equal one process on the global batch.

    Tolerances: the ranks' gradients are averaged in another order than one process sums them (float32 rounding),
    and AdamW divides by sqrt(v): a parameter whose gradient is ~0 moves by up to lr times that rounding.
    """
    assert run.ok, f"{what}: {run.failure}"
    for result in run.results:
        steps = [record["step"] for record in result["history"]]
        assert steps == [record["step"] for record in reference["history"]], f"{what}: steps {steps}"
        for mine, theirs in zip(result["history"], reference["history"]):
            torch.testing.assert_close(mine["loss"], theirs["loss"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine["grad_norm"], theirs["grad_norm"], rtol=1e-4, atol=1e-5)
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-3, atol=1e-4,
                                       msg=lambda m: f"{what}, rank {result['rank']}, {name}: {m}")
    assert len({r["history"][-1]["params"] for r in run.results}) == 1, f"{what}: the replicas differ"


def test_the_correct_job_on_two_ranks_equals_one_process(tmp_path):
    run = run_job("base", 2, out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert_equals_one_process(run, one_process("base", 2), "base job")
    assert run.collectives[0][DDP_BUCKETS] == run.results[0]["steps"]  # one bucket, all-reduced once per step
    assert (run.folder / "train_job.py").read_text() == BASE_SOURCE
    assert "done after 12 steps" in run.log(1)


HANGS = {  # job -> what the launcher's report says about a rank
    "job_01": "rank 0 waited in all_reduce, called at",
    "job_02": "rank 1 waited in barrier, called at",
    "job_04": "waited in DistributedDataParallel",
    "job_05": "in evaluate: dist.all_reduce(totals)",
}
CRASHES = {
    "job_03": "doesn't match expected size",
    "job_06": 'Unexpected key(s) in state_dict: "module.',
    "job_07": "No such file or directory",
    "job_08": "Expected to have finished reduction in the prior iteration",
}


@pytest.mark.parametrize("name", sorted(HANGS))
def test_a_job_that_hangs_is_reported_with_the_line_each_rank_waits_at(name, tmp_path):
    run = run_job(name, out_dir=tmp_path, timeout_s=HANG_TIMEOUT_S)
    assert not run.ok
    report = str(run.failure)
    assert "collective timed out" in report and HANGS[name] in report, report
    assert all("train_job.py:" in place or "returned" in place for place in run.failure.places.values()), report


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_a_job_that_crashes_names_the_rank_and_the_error(name, tmp_path):
    run = run_job(name, out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert not run.ok
    assert CRASHES[name] in str(run.failure) + run.log(run.failure.rank), str(run.failure)


def test_mismatched_collectives_are_named_by_the_debug_report(tmp_path):
    run = run_job("job_05", out_dir=tmp_path, timeout_s=HANG_TIMEOUT_S, debug="DETAIL")
    report = str(run.failure) + "".join(run.log(r) for r in range(2))
    assert "Detected mismatch between collectives on ranks" in report
    assert "TensorShape=[2]" in report and "TensorShape=[1]" in report


def test_silent_jobs_leave_their_traces(tmp_path):
    reference = one_process("base", 2)
    drift = run_job("job_10", out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert drift.ok and drift.steps("params") == []  # rank 0 resumed at step 13, rank 1 started again at 1
    assert drift.results[0]["history"][-1]["params"] != drift.results[1]["history"][-1]["params"]
    traffic = run_job("job_11", out_dir=tmp_path, timeout_s=TIMEOUT_S)
    accum = traffic.settings["grad_accum"]
    assert traffic.collectives[0][DDP_BUCKETS] == accum * traffic.results[0]["steps"]
    # clip_grad_norm_ returns the norm before clipping: at step 1 (same weights) it shows the gradients' scale
    halved = run_job("job_12", out_dir=tmp_path, timeout_s=TIMEOUT_S)
    first = halved.results[0]["history"][0]["grad_norm"]
    assert first == pytest.approx(reference["history"][0]["grad_norm"] / 2, rel=1e-4)
    summed = run_job("job_13", out_dir=tmp_path, timeout_s=TIMEOUT_S)
    accum = summed.settings["grad_accum"]
    assert summed.results[0]["history"][0]["grad_norm"] == pytest.approx(
        accum * one_process("job_13", 2)["history"][0]["grad_norm"], rel=1e-4)


def test_without_set_epoch_every_epoch_reads_the_same_order(tmp_path):
    run = run_job("job_09", out_dir=tmp_path, timeout_s=TIMEOUT_S)
    module, config = run.script(), run.config()
    dataset, _ = module.build_data(config)
    loader, sampler = module.make_loader(dataset, config, 0, 2)
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)  # what train() omits
        orders.append(list(sampler))
    assert orders[0] != orders[1]
    assert "set_epoch" not in inspect.getsource(module.train)


FIXES = {  # job -> the functions of the correct script that put it right (every fix is graded on ranks by
    # tests/course/test_grading.py; these two check what no parity test sees: the data shared out, the traffic)
    "job_04": ["make_loader"], "job_11": ["train_step"],
}


@pytest.mark.parametrize("name", sorted(FIXES))
def test_the_correct_functions_fix_the_job(name, tmp_path):
    from course_lib.debugging.checks import assert_fixed, assert_replicas_agree, assert_windows_shared_out

    fixes = [getattr(train_job, function) for function in FIXES[name]]
    run = run_job(name, out_dir=tmp_path, fixes=fixes, timeout_s=TIMEOUT_S)
    if name == "job_04":  # its data are shared out differently from one process's
        assert_replicas_agree(run, name)
        assert_windows_shared_out(run.script(), run.config(), 2, name)
        script = tmp_path / "broken_job.py"
        script.write_text(script_of(name))
        broken = import_script(str(script), "broken_job_04")  # the job as it is, not run
        with pytest.raises(AssertionError, match="the ranks read"):
            assert_windows_shared_out(broken, broken.JobConfig(**JOBS[name].config), 2, name)
        return
    assert_fixed(run, one_process(name, 2), name)
    assert run.collectives[0][DDP_BUCKETS] == run.results[0]["steps"]

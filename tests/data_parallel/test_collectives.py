"""The one-tensor all-gather and reduce-scatter under torch's current names, and the older names' fallback.

    .venv/bin/python -m pytest -q tests/data_parallel/test_collectives.py

torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and
reduce_scatter_single, and the old names print a FutureWarning at every call site of every rank; torch 2.11
has only the old names. course_lib.data_parallel.collectives calls whichever the installed torch has.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from course_lib.data_parallel import collectives
from course_lib.data_parallel.collectives import all_gather_single, reduce_scatter_single
from course_lib.runtime.launch import launch
from course_lib.runtime.spawn import single_process_group


def test_current_names_give_the_collectives_and_no_warning():
    with single_process_group(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning of a deprecated name fails the test
        gathered = torch.empty(3)
        all_gather_single(gathered, torch.tensor([1.0, 2.0, 3.0]))
        torch.testing.assert_close(gathered, torch.tensor([1.0, 2.0, 3.0]))
        reduced = torch.empty(4)
        reduce_scatter_single(reduced, torch.arange(4.0), op=dist.ReduceOp.SUM)
        torch.testing.assert_close(reduced, torch.arange(4.0))
        work = all_gather_single(gathered, torch.ones(3), async_op=True)
        work.wait()
        torch.testing.assert_close(gathered, torch.ones(3))


def test_a_torch_without_the_current_names_gets_the_older_ones(monkeypatch):
    called = []
    for current, older in (("all_gather_single", "all_gather_into_tensor"),
                           ("reduce_scatter_single", "reduce_scatter_tensor")):
        monkeypatch.delattr(dist, current, raising=False)  # torch 2.11
        real = getattr(dist, older)
        monkeypatch.setattr(dist, older, lambda *args, _real=real, _name=older, **kwargs: (called.append(_name),
                                                                                          _real(*args, **kwargs))[1])
    with single_process_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gathered = torch.empty(2)
        collectives.all_gather_single(gathered, torch.tensor([5.0, 6.0]))
        reduced = torch.empty(2)
        collectives.reduce_scatter_single(reduced, torch.tensor([7.0, 8.0]))
    assert called == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    torch.testing.assert_close(gathered, torch.tensor([5.0, 6.0]))
    torch.testing.assert_close(reduced, torch.tensor([7.0, 8.0]))


@pytest.mark.distributed
def test_zero_on_two_ranks_prints_no_deprecation_warning(tmp_path):
    from course_lib.sharding.zero_workers import zero_parity_run

    launch(zero_parity_run, 2, kwargs=dict(stages=(1, 2, 3), steps=1), log_dir=tmp_path, echo=False,
           threads_per_rank=1)
    for log in sorted(tmp_path.glob("rank_*/train.log")):
        text = log.read_text()
        assert "FutureWarning" not in text and "is deprecated" not in text, f"{log}:\n{text[-3000:]}"
    assert len(list(tmp_path.glob("rank_*/train.log"))) == 2

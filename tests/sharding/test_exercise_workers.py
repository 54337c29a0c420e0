"""The ZeRO exercises' worker (course_lib/sharding/zero_workers.py) counts every all-gather and reduce-scatter
and refuses the all-reduce, whatever road an answer takes to the network (D/02b's tests run through it).

    .venv/bin/python -m pytest -q tests/sharding/test_exercise_workers.py
"""

import pytest
import torch
import torch.distributed as dist

from course_lib.runtime.launch import launch
from course_lib.sharding.zero_workers import check_zero


def averaged_by_another_road(model, lr, momentum):
    """DDP, not ZeRO: the all-reduce called through distributed_c10d instead of dist."""
    from torch.distributed import distributed_c10d

    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

    def step():
        for param in model.parameters():
            distributed_c10d.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
        optimizer.step()
    return step


def gathered_behind_the_counters_back(model, lr, momentum):
    """Gradients averaged with the process group's own all-gather: traffic the counters never see."""
    from torch.distributed import distributed_c10d

    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

    def step():
        group, world_size = distributed_c10d._get_default_group(), dist.get_world_size()
        for param in model.parameters():
            flat = param.grad.reshape(-1).contiguous()
            gathered = torch.empty(world_size * flat.numel())
            group._allgather_base(gathered, flat).wait()
            param.grad.copy_(gathered.view(world_size, -1).mean(0).view_as(param.grad))
        optimizer.step()
    return step


@pytest.mark.parametrize(("answer", "message"), [
    (averaged_by_another_road, "CollectiveRefused: ZeRO replaces DDP's all-reduce"),
    (gathered_behind_the_counters_back, "all-gathers or reduce-scatters ran without dist."),
], ids=["all-reduce through distributed_c10d", "all-gather through the process group"])
def test_collectives_by_another_road_are_refused_or_reported(tmp_path, monkeypatch, answer, message):
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "fork")
    ranks = launch(check_zero, 2, args=(answer,), kwargs=dict(stage=1, steps=1), log_dir=tmp_path, timeout_s=60,
                   threads_per_rank=1, echo=False)
    for rank in ranks:
        assert rank["error"] is not None and message in rank["error"], rank["error"]

"""Pipeline communication: a blocking send waits for its receiver (so two neighbours that both send first hang),
and the stage-loop check (course_lib/pipeline_parallel/comm_workers.py) that grades E/02b's exercise 4 sees what
a stage loop does on real ranks: its result against one process, its order, its messages.

    .venv/bin/python -m pytest -q tests/pipeline_parallel/test_stage_loop.py
"""

import pytest
import torch
import torch.distributed as dist

from course_lib.pipeline_parallel import check_stage_loop, exchange, max_in_flight, stage_loop_reference
from course_lib.runtime.launch import RankFailure, launch
from course_lib.runtime.spawn import spawnable

pytestmark = pytest.mark.distributed
LAYERS = dict(n_layer=4)


def stage_loop(stage, actions, micro_batches, hidden_shape, loss_fn):
    """Every send asynchronous, every receive blocking; the sends waited for at the end."""
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    m = len(micro_batches)
    inputs, outputs, losses, sends = {}, {}, [], []
    for kind, i in actions:
        if kind == "F":
            if first:
                x = micro_batches[i]
            else:
                x = torch.empty(hidden_shape)
                dist.recv(x, src=rank - 1, tag=i)
                x.requires_grad_()
            y = stage(x)
            if last:
                y = loss_fn(y, micro_batches[i]) / m
                losses.append(y.item())
            else:
                sends.append(dist.isend(y.detach(), dst=rank + 1, tag=i))
            inputs[i], outputs[i] = x, y
        else:
            x, y = inputs.pop(i), outputs.pop(i)
            if last:
                y.backward()
            else:
                grad = torch.empty(hidden_shape)
                dist.recv(grad, src=rank + 1, tag=i)
                y.backward(grad)
            if not first:
                sends.append(dist.isend(x.grad, dst=rank - 1, tag=i))
    for work in sends:
        work.wait()
    return sum(losses) if last else None


def blocking_stage_loop(stage, actions, micro_batches, hidden_shape, loss_fn):
    """The naive loop: dist.send right after each forward and each backward."""
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    inputs, outputs = {}, {}
    for kind, i in actions:
        if kind == "F":
            x = micro_batches[i]
            if not first:
                x = torch.empty(hidden_shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            y = stage(x)
            if last:
                y = loss_fn(y, micro_batches[i]) / len(micro_batches)
            else:
                dist.send(y.detach(), dst=rank + 1)
            inputs[i], outputs[i] = x, y
        else:
            x, y = inputs.pop(i), outputs.pop(i)
            if last:
                y.backward()
            else:
                grad = torch.empty(hidden_shape)
                dist.recv(grad, src=rank + 1)
                y.backward(grad)
            if not first:
                dist.send(x.grad, dst=rank - 1)
    return None


def test_two_ranks_that_both_send_first_wait_for_each_other(tmp_path):
    with pytest.raises(RankFailure) as failure:
        launch(exchange, 2, kwargs=dict(order="send_first"), log_dir=tmp_path, timeout_s=3, echo=False)
    report = str(failure.value)
    assert "collective timed out" in report
    for rank in (0, 1):
        assert f"rank {rank} waited in send, called at course_lib/pipeline_parallel/comm_workers.py" in report, report
    for order in ("recv_first_on_odd", "batched"):
        ranks = launch(exchange, 2, kwargs=dict(order=order, numel=1000), log_dir=tmp_path, timeout_s=30, echo=False)
        assert [r["received"] for r in ranks] == [1.0, 0.0], order


@pytest.mark.parametrize(("world_size", "schedule", "micro_batches"), [(2, "1f1b", 4), (4, "1f1b", 4), (3, "gpipe", 2)])
def test_a_right_stage_loop_equals_one_process_and_sends_one_message_per_micro_batch(tmp_path, world_size, schedule,
                                                                                     micro_batches):
    ranks = launch(check_stage_loop, world_size, args=(spawnable(stage_loop),),
                   kwargs=dict(schedule=schedule, micro_batches=micro_batches, config_overrides=LAYERS),
                   log_dir=tmp_path, timeout_s=60, echo=False)
    reference = stage_loop_reference(config_overrides=LAYERS)
    hidden_bytes = 8 // micro_batches * 16 * 64 * 4  # (b, T, n_embd) float32 per micro-batch
    for r in ranks:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], msg=f"stage {r['stage']}: gradient of {name}")
        for name, param in r["params"].items():
            torch.testing.assert_close(param, reference["params"][name], msg=f"stage {r['stage']}: {name}")
        kinds = [kind for kind, _ in r["actions"]]
        assert r["events"] == [kinds, kinds] and r["peak_in_flight"] == [max_in_flight(r["actions"])] * 2
        s = r["stage"]
        expected = sorted([(s + 1, i, hidden_bytes) for i in range(micro_batches)] * (s < world_size - 1)
                          + [(s - 1, i, hidden_bytes) for i in range(micro_batches)] * (s > 0))
        assert sorted(r["sent"][0]) == expected and sorted(r["received"][0]) == expected
    assert ranks[-1]["returned"] == pytest.approx(reference["losses"], rel=1e-5)
    assert all(r["returned"] == [None, None] for r in ranks[:-1])
    assert len(reference["grads"]) == sum(len(r["grads"]) for r in ranks) - 1  # the tied matrix is on both ends


def test_the_blocking_loop_hangs_and_the_report_names_both_sends(tmp_path):
    with pytest.raises(RankFailure) as failure:
        launch(check_stage_loop, 2, args=(spawnable(blocking_stage_loop),), log_dir=tmp_path, timeout_s=3, echo=False)
    report = str(failure.value)
    assert "rank 0 waited in send, called at" in report and "in blocking_stage_loop" in report, report
    assert "dist.send(y.detach(), dst=rank + 1)" in report and "dist.send(x.grad, dst=rank - 1)" in report, report


def test_a_receive_must_name_its_source_and_every_parameter_needs_its_gradient(tmp_path):
    def any_source(stage, actions, micro_batches, hidden_shape, loss_fn):
        dist.recv(torch.empty(hidden_shape))
    with pytest.raises(RankFailure, match="a receive must name its peer rank: src= is missing"):
        launch(check_stage_loop, 2, args=(spawnable(any_source),), log_dir=tmp_path, timeout_s=10, echo=False)
    with pytest.raises(RankFailure, match="parameter.s. of the stage have no gradient"):
        launch(check_stage_loop, 2, args=(spawnable(no_backward),), log_dir=tmp_path, timeout_s=10, echo=False)


def no_backward(stage, actions, micro_batches, hidden_shape, loss_fn):
    return None

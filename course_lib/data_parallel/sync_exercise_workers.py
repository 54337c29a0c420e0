"""Rank workers that grade notebook 02's exercises: the learner's gradient synchronisation and ring all-reduce.

Each worker runs the learner's function (made importable by course_lib.runtime.spawn.spawnable) on every
rank and records what it did with torch.distributed: every all_reduce (its size, whether it was launched
inside backward, whether its work was waited for) and every point-to-point send. The test cells compare
the gradients with one process (sync_reference) and the calls with what the algorithm must do.

    ranks = launch(check_gradient_sync, 3, args=(spawnable(allreduce_gradients),), kwargs={"style": "after"})
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from course_lib.data_parallel.ddp import assign_buckets
from course_lib.data_parallel.collective_gate import COLLECTIVES, process_group_calls
from course_lib.parity import global_batches, gradients, local_rows, seeded_gpt

FROZEN = ("blocks.0.attn.q_proj.weight", "norm_f.weight")
"""Parameters frozen in the second case: no gradient, so no communication for them."""
SYNC_STYLES = ("after", "hooks", "buckets")


def _model(seed: int, frozen: tuple[str, ...]):
    model = seeded_gpt(seed, "tiny")
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass (in a gradient hook, say)."""
    return torch._C._current_graph_task_id() != -1


class _RecordedWork:
    """An async collective's work handle that notes when it is waited for."""

    def __init__(self, work, record: dict):
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        self._record["waited"] = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        return self._work.is_completed()


def expected_bucket_sizes(model, bucket_cap_mb: float) -> list[int]:
    """Elements per bucket, in the order backward completes them: trainable parameters in reverse order, each
    bucket closed once it holds bucket_cap_mb MiB or more (torch DDP's rule, scratch.assign_buckets)."""
    params = list(reversed([p for p in model.parameters() if p.requires_grad]))
    return [sum(params[i].numel() for i in bucket) for bucket in assign_buckets(params, int(bucket_cap_mb * 2**20))]


def check_gradient_sync(sync_fn, *, style: str, bucket_cap_mb: float = 0.06, steps: int = 2,
                        rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """Worker: `steps` backward passes on identical replicas, each rank on its rows, synchronised by sync_fn.

    style "after":   sync_fn(model) after each backward (the naive all-reduce per gradient);
    style "hooks":   finish = sync_fn(model) once, then finish() after each backward;
    style "buckets": finish = sync_fn(model, bucket_cap_mb) once, then finish() after each backward.
    Returns, per case ("all" parameters trainable, "frozen"), the gradients after every step and every
    all_reduce call: numel, launched inside backward, async, waited for before finish() returned.
    """
    if style not in SYNC_STYLES:
        raise ValueError(f"style must be one of {SYNC_STYLES}, got {style!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"rank": rank, "world_size": world_size}
    real_all_reduce = dist.all_reduce
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _model(seed, frozen)
        calls: list[dict] = []

        def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            record = {"numel": tensor.numel(), "in_backward": _in_backward(), "async": async_op, "waited": False}
            calls.append(record)
            work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
            return _RecordedWork(work, record) if async_op else work

        batches = global_batches(steps, rows_per_rank * world_size, seq_len, seed)
        per_step = []
        try:
            with mock.patch.object(dist, "all_reduce", recording_all_reduce):
                finish = None
                if style == "hooks":
                    finish = sync_fn(model)
                elif style == "buckets":
                    finish = sync_fn(model, bucket_cap_mb)
                if style != "after" and not callable(finish):
                    raise TypeError(f"return the function that finishes the synchronisation, got {finish!r}")
                for step, batch in enumerate(batches):
                    model.zero_grad(set_to_none=True)
                    rows = local_rows(batch, rank, world_size)
                    first_call = len(calls)
                    model(rows, targets=rows)[1].backward()
                    launched_in_backward = len(calls) - first_call
                    if style == "after":
                        sync_fn(model)
                    else:
                        finish()
                    step_calls = calls[first_call:]
                    per_step.append({"grads": gradients(model), "calls": [dict(c) for c in step_calls],
                                     "launched_in_backward": launched_in_backward})
        except Exception as err:  # noqa: BLE001 (reported to the test cell, which fails the check)
            results[case] = {"error": f"{type(err).__name__}: {err}"}
            continue
        results[case] = {"error": None, "steps": per_step,
                         "bucket_sizes": expected_bucket_sizes(model, bucket_cap_mb)}
    return results


def sync_reference(world_size: int, *, steps: int = 2, rows_per_rank: int = 2, seq_len: int = 16,
                   seed: int = 0) -> dict:
    """One process, each whole global batch: {case: [gradients of step 0, step 1, ...]} every rank must hold."""
    reference = {}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _model(seed, frozen)
        reference[case] = []
        for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
            model.zero_grad(set_to_none=True)
            model(batch, targets=batch)[1].backward()
            reference[case].append(gradients(model))
    return reference


def rank_tensor(rank: int, shape: tuple[int, ...], seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """The tensor rank `rank` contributes to the ring check (every rank can compute every rank's)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank * 31 + sum(shape))
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


RING_REFUSAL = "build the ring from dist.isend / dist.recv: collectives such as dist.all_reduce are what you are writing"
RING_SHAPES = ((12,), (6, 5), (1,), (7,), (4099,))
"""Even sizes first (the visible tests), then uneven chunks and a single element (the hidden ones)."""


def check_ring_all_reduce(ring_fn, *, shapes=RING_SHAPES, seed: int = 0) -> dict:
    """Worker: ring_fn(tensor) on each shape, with the collectives refused; what it returned and what it sent.

    Every collective of the process group (all-reduce, reduce-scatter, all-gather, broadcast, reduce, all-to-all,
    by whatever function it is reached: course_lib.data_parallel.collective_gate) raises: the ring must be built from
    point-to-point messages, which are counted where they leave, in elements. Returns per shape: the result,
    the expected sum (computed from every rank's tensor), whether the input tensor itself holds the sum, and the
    elements and messages this rank sent.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"rank": rank, "world_size": world_size, "cases": []}
    for shape in shapes:
        tensor = rank_tensor(rank, shape, seed)
        expected = sum(rank_tensor(r, shape, seed) for r in range(world_size))
        calls = []
        try:
            with process_group_calls(refused=COLLECTIVES, reason=RING_REFUSAL) as calls:
                returned = ring_fn(tensor)
            error = None
        except Exception as err:  # noqa: BLE001 (reported to the test cell)
            returned, error = None, f"{type(err).__name__}: {err}"
        sends = [call for call in calls if call.kind == "send"]
        results["cases"].append({
            "shape": shape, "error": error, "expected": expected,
            "returned": returned.detach().clone() if isinstance(returned, torch.Tensor) else returned,
            "in_place": tensor.detach().clone(), "returned_is_input": returned is tensor,
            "sent_elements": sum(call.elements for call in sends), "messages": len(sends)})
        if error:
            break  # the ranks may be out of step now: stop before a mismatched exchange hangs
    return results

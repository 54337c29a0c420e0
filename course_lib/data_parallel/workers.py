"""Rank workers for data parallelism: three ways, checked against one process.

    from course_lib.runtime.launch import launch
    from course_lib.data_parallel.workers import data_parallel_run
    from course_lib.parity import single_process_run
    ranks = launch(data_parallel_run, world_size=2, kwargs=dict(strategy="bucketed", steps=3))
    reference = single_process_run(steps=3)

Rank workers that grade the data-parallel exercises: the learner's function on every rank, next to DDP.

The check_* workers run a learner's function (made importable by course_lib.runtime.spawn.spawnable) on
every rank next to torch's DistributedDataParallel; gradient_averaging_reference and
train_steps_one_process compute, in one process and with course_lib's code, what the ranks must match.

    ranks = launch(check_gradient_averaging, 3, args=(spawnable(data_parallel_backward),))

Rank workers that grade notebook 02's exercises: the learner's gradient synchronisation and ring all-reduce.

Each worker runs the learner's function (made importable by course_lib.runtime.spawn.spawnable) on every
rank and records what it did with torch.distributed: every all_reduce (its size, whether it was launched
inside backward, whether its work was waited for) and every point-to-point send. The test cells compare
the gradients with one process (sync_reference) and the calls with what the algorithm must do.

    ranks = launch(check_gradient_sync, 3, args=(spawnable(allreduce_gradients),), kwargs={"style": "after"})
"""

from __future__ import annotations

import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.model import GPT
from course_lib.core.optim import make_scheduler
from course_lib.core.steps import train_step
from course_lib.data_parallel.collective_gate import COLLECTIVES, process_group_calls
from course_lib.data_parallel.collectives import ring_all_reduce
from course_lib.data_parallel.ddp import allreduce_gradients, assign_buckets, broadcast_parameters, BucketedDataParallel
from course_lib.parity import global_batches, gradients, local_rows, seeded_gpt
from course_lib.runtime.env import get_dist_info

GRADIENT_SYNCS = ("naive", "bucketed", "torch_ddp")


def data_parallel_run(strategy: str = "naive", steps: int = 3, preset: str = "tiny", global_batch: int = 8,
                      seq_len: int = 32, seed: int = 0, bucket_cap_mb: float = 0.05) -> dict:
    """Each rank trains on its rows of the global batch and synchronises gradients with `strategy`.

    Returns this rank's first-step gradients, final parameters, per-step local losses and a timeline.
    """
    if strategy not in GRADIENT_SYNCS:
        raise ValueError(f"strategy must be one of {GRADIENT_SYNCS}, got {strategy!r}")
    info = get_dist_info()
    model = seeded_gpt(seed + info.rank, preset)  # different init per rank: the broadcast must fix it
    if strategy == "naive":
        broadcast_parameters(model)
        wrapped = model
    elif strategy == "bucketed":
        wrapped = BucketedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    first_grads, losses, timeline = [], [], []

    def synchronised_step(micro_batches):  # forward, backward and the sync of `strategy`, timed
        loss, intervals = timed_sync_step(model, wrapped, micro_batches[0])
        timeline.extend(intervals)
        return loss

    for batch in global_batches(steps, global_batch, seq_len, seed):
        keep_first = (lambda: first_grads.append(gradients(model))) if not first_grads else None
        stats = train_step(model, [local_rows(batch, info.rank, info.world_size)], optimizer,
                           forward_backward=synchronised_step, after_backward=keep_first, grad_norm=False)
        losses.append(stats["loss"])
    dist.barrier()
    return {"rank": info.rank, "grads": first_grads[0], "losses": losses, "timeline": timeline,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def timed_sync_step(model, wrapped, rows) -> tuple[torch.Tensor, list[tuple[str, float, float]]]:
    """Forward, backward and gradient sync of one data-parallel step; returns (loss, (kind, start, end) intervals).

    wrapped is model itself (the naive sync: every gradient's all_reduce after backward), a BucketedDataParallel
    (its all_reduces were launched during backward: wait for them) or torch's DDP (done inside backward).
    The intervals: forward, backward, the all-reduces as far as they can be seen, and a zero-length step_end.
    """
    model.zero_grad(set_to_none=True)
    start = time.monotonic()
    _, loss = wrapped(rows, targets=rows)
    forward_end = time.monotonic()
    loss.backward()
    backward_end = time.monotonic()
    if wrapped is model:
        allreduce_gradients(model)
        comm = [("allreduce", backward_end, time.monotonic())]
    elif isinstance(wrapped, BucketedDataParallel):
        first = len(wrapped.timeline)
        wrapped.finish_gradient_sync()
        comm = wrapped.timeline[first:]
    else:
        comm = []
    end = time.monotonic()
    return loss, [("forward", start, forward_end), ("backward", forward_end, backward_end), *comm, ("step_end", end, end)]


def ring_allreduce_check(numels=(1, 7, 1000), seed: int = 0) -> list[dict]:
    """Ring all-reduce and dist.all_reduce on the same random tensors; return both results per size."""
    info = get_dist_info()
    results = []
    for numel in numels:
        data = torch.randn(numel, generator=torch.Generator().manual_seed(seed + info.rank))
        reference = data.clone()
        dist.all_reduce(reference)
        results.append({"numel": numel, "ring": ring_all_reduce(data.clone()), "reference": reference})
    return results


def _tiny_model(seed: int, frozen: tuple[str, ...] = ()) -> GPT:
    model = seeded_gpt(seed, "tiny")
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


FROZEN = ("blocks.0.attn.q_proj.weight", "norm_f.weight")
"""Parameters frozen in the second case of the gradient checks: their .grad stays None, so no communication
for them."""


def check_gradient_averaging(backward_fn, *, rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """Worker: each rank calls backward_fn(model, its rows) on identical replicas; returns what it left in .grad.

    Two cases: every parameter trainable ("all"), and FROZEN parameters without gradients ("frozen").
    A case that raises is reported as {"error": ...} so the other case is still checked.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"rank": rank, "world_size": world_size}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _tiny_model(seed, frozen)
        rows = local_rows(global_batches(1, rows_per_rank * world_size, seq_len, seed)[0], rank, world_size)
        try:
            loss = backward_fn(model, rows)
        except Exception as err:  # noqa: BLE001 (reported to the caller, which fails the check)
            results[case] = {"error": f"{type(err).__name__}: {err}"}
            continue
        with torch.no_grad():
            local_loss = model(rows, targets=rows)[1].item()
        results[case] = {"error": None, "grads": gradients(model), "local_loss": local_loss,
                         "returned_loss": float(loss) if isinstance(loss, (torch.Tensor, float, int)) else loss}
    return results


def gradient_averaging_reference(world_size: int, *, rows_per_rank: int = 2, seq_len: int = 16,
                                 seed: int = 0) -> dict:
    """One process, the whole global batch: the gradients every rank must hold after averaging."""
    reference = {}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _tiny_model(seed, frozen)
        batch = global_batches(1, rows_per_rank * world_size, seq_len, seed)[0]
        model(batch, targets=batch)[1].backward()
        reference[case] = gradients(model)
    return reference


def _step_setup(seed: int, lr: float, steps: int):
    model = _tiny_model(seed)
    # SGD, not AdamW: its update is proportional to the gradient, so a wrong scale shows in the weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = make_scheduler(optimizer, max_lr=lr, min_lr=lr / 10, warmup_steps=1, max_steps=steps)
    return model, optimizer, scheduler


def check_train_step(train_step_fn, *, steps: int = 3, grad_accum_steps: int = 3, micro_batch: int = 1,
                     seq_len: int = 16, lr: float = 0.5, seed: int = 0) -> dict:
    """Worker: `steps` calls of train_step_fn on a DDP model, passing no_sync=ddp.no_sync.

    Returns this rank's records (what train_step_fn returned), final weights, and the all-reduces DDP
    launched in each step next to the number one synchronised backward launches.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = _step_setup(seed, lr, steps)
    ddp = DistributedDataParallel(model)
    launched = []

    def counting_allreduce(state, bucket):
        launched.append(bucket.index())
        return allreduce_hook(None, bucket)  # DDP's own averaging all-reduce, counted

    ddp.register_comm_hook(None, counting_allreduce)
    batches = global_batches(steps * grad_accum_steps, micro_batch * world_size, seq_len, seed)
    records, allreduces_per_step = [], []
    for step in range(steps):
        micro_batches = [local_rows(b, rank, world_size) for b in batches[step * grad_accum_steps:][:grad_accum_steps]]
        before = len(launched)
        records.append(train_step_fn(ddp, micro_batches, optimizer, scheduler, no_sync=ddp.no_sync))
        allreduces_per_step.append(len(launched) - before)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    # One ordinary synchronised backward: how many all-reduces "communicate once" means for this model.
    before = len(launched)
    ddp(micro_batches[0], targets=micro_batches[0])[1].backward()
    return {"rank": rank, "world_size": world_size, "records": records, "params": params,
            "allreduces_per_step": allreduces_per_step, "allreduces_per_backward": len(launched) - before}


def train_steps_one_process(train_step_fn=None, world_size: int = 2, *, steps: int = 3, grad_accum_steps: int = 3,
                            micro_batch: int = 1, seq_len: int = 16, lr: float = 0.5, seed: int = 0,
                            grad_clip: float | None = None) -> dict:
    """The same steps in one process, every rank's rows in each micro-batch (default: course_lib's train_step).

    With world_size ranks of `micro_batch` rows each, this is what check_train_step's ranks must match.
    """
    train_step_fn = train_step_fn or train_step
    model, optimizer, scheduler = _step_setup(seed, lr, steps)
    batches = global_batches(steps * grad_accum_steps, micro_batch * world_size, seq_len, seed)
    records = [train_step_fn(model, batches[step * grad_accum_steps:][:grad_accum_steps], optimizer, scheduler,
                             grad_clip=grad_clip)
               for step in range(steps)]
    return {"records": records, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


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

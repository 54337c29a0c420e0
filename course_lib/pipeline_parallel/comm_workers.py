"""Rank workers for pipeline communication: where a stage's sends deadlock, and the check of a stage loop.

    from course_lib.runtime.launch import launch
    from course_lib.pipeline_parallel.comm_workers import exchange, check_stage_loop
    launch(exchange, 2, kwargs=dict(order="batched"))               # returns
    launch(exchange, 2, kwargs=dict(order="send_first"), timeout_s=5)   # hangs: both ranks wait in dist.send
    ranks = launch(check_stage_loop, 4, args=(spawnable(run_stage),), kwargs=dict(schedule="1f1b"))

`check_stage_loop` grades the pipeline-communication exercise (Session E, notebook 02b): the learner's
`run_stage(stage, actions, micro_batches, hidden_shape, loss_fn)` runs one stage of a GPT split over the ranks,
and the worker records what it did: the order of the stage's forwards and backwards, the micro-batches in flight,
every message and its bytes (course_lib.pipeline_parallel.p2p_record).

A blocking `dist.send` returns once its receiver has taken the message, on gloo as with NCCL: two neighbours that
both send before they receive wait for each other until the collective timeout.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib.core.steps import train_step
from course_lib.parity import global_batches, seeded_gpt, train_whole_batches
from course_lib.pipeline_parallel.p2p_record import record_p2p
from course_lib.pipeline_parallel.schedules import schedule_actions
from course_lib.pipeline_parallel.stage import (
    GPTStage,
    allreduce_tied_grad,
    broadcast_tied_weight,
    full_model_name,
    shifted_cross_entropy,
    tied_weight_group,
)
from course_lib.pipeline_parallel.workers import _optimizer
from course_lib.runtime.env import get_dist_info

EXCHANGE_ORDERS = ("send_first", "recv_first_on_odd", "batched")


def exchange(order: str = "send_first", numel: int = 1 << 16) -> dict:
    """Two ranks swap a tensor of `numel` floats, as two pipeline neighbours swap an activation and a gradient.

    order "send_first": each rank calls dist.send, then dist.recv (the naive order);
    "recv_first_on_odd": rank 1 receives first, then sends (the order is broken by parity);
    "batched": one dist.batch_isend_irecv with both operations, then wait.
    Returns {"rank", "received" (the first value of what arrived), "seconds"}.
    """
    if order not in EXCHANGE_ORDERS:
        raise ValueError(f"order must be one of {EXCHANGE_ORDERS}, got {order!r}")
    info = get_dist_info()
    if info.world_size != 2:
        raise ValueError(f"exchange runs on 2 ranks, not {info.world_size}")
    peer = 1 - info.rank
    mine, theirs = torch.full((numel,), float(info.rank)), torch.empty(numel)
    start = time.perf_counter()
    if order == "send_first":
        dist.send(mine, dst=peer)
        dist.recv(theirs, src=peer)
    elif order == "recv_first_on_odd":
        if info.rank % 2:
            dist.recv(theirs, src=peer)
            dist.send(mine, dst=peer)
        else:
            dist.send(mine, dst=peer)
            dist.recv(theirs, src=peer)
    else:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
        for work in works:
            work.wait()
    return {"rank": info.rank, "received": theirs[0].item(), "seconds": time.perf_counter() - start}


def _watch_stage(stage, events: list):
    """Record ("F",) when the stage runs forward and ("B",) when the gradient of its output arrives (the start of
    that micro-batch's backward through the stage). Returns the hook handles."""
    def on_forward(module, inputs, output):
        events.append("F")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: events.append("B"))
    return [stage.register_forward_hook(on_forward)]


def peak_in_flight(events) -> int:
    """Most micro-batches between their forward and the start of their backward, from ["F", "B", ...]."""
    alive = peak = 0
    for event in events:
        alive += 1 if event == "F" else -1
        peak = max(peak, alive)
    return peak


def check_stage_loop(run_stage, *, schedule: str = "1f1b", micro_batches: int = 4, steps: int = 2,
                     global_batch: int = 8, seq_len: int = 16, seed: int = 0, lr: float = 0.05,
                     config_overrides: dict | None = None) -> dict:
    """Worker: train a GPT split over the ranks (stage = rank) for `steps` steps, each step's forward and backward
    run by `run_stage(stage, actions, micro_batches, hidden_shape, loss_fn)`, its messages recorded.

    The worker builds the stage, hands it this rank's actions under `schedule` and the step's micro-batches, then
    does what surrounds a pipeline step: the tied embedding's gradient all-reduce and SGD. Returns the stage's
    layers, its first-step gradients and final parameters under the full model's names, what run_stage returned
    per step, and per step: the forward/backward events, the peak in flight, the messages sent and received
    ((peer, tag, bytes)), and the sends waited for.
    """
    if global_batch % micro_batches:
        raise ValueError(f"global_batch={global_batch} does not split into micro_batches={micro_batches} equal parts")
    info = get_dist_info()
    model = seeded_gpt(seed, "tiny", **(config_overrides or {}))
    stage = GPTStage(model, info.rank, info.world_size).to(info.device)
    group = tied_weight_group(info.world_size)
    broadcast_tied_weight(stage, group)
    opt = _optimizer(stage.parameters(), "sgd", lr)
    actions = schedule_actions(schedule, info.world_size, info.rank, micro_batches)
    result = {"rank": info.rank, "stage": info.rank, "layers": list(stage.layers), "actions": actions,
              "returned": [], "events": [], "peak_in_flight": [], "sent": [], "received": [],
              "grads": None}
    events: list = []
    handles = _watch_stage(stage, events)

    def keep_first_grads():
        missing = [name for name, p in stage.named_parameters() if p.grad is None]
        if missing:
            raise RuntimeError(f"stage {info.rank}: after run_stage, {len(missing)} parameter(s) of the stage have no "
                               f"gradient, {missing[0]} first: every micro-batch's backward must run through the stage")
        allreduce_tied_grad(stage, group)
        if result["grads"] is None:
            result["grads"] = {full_model_name(n): p.grad.detach().cpu().clone()
                               for n, p in stage.named_parameters() if p.grad is not None}

    def forward_backward(batches):
        tokens = batches[0].to(info.device)
        b = tokens.shape[0] // micro_batches
        pieces = [tokens[i * b:(i + 1) * b] for i in range(micro_batches)]
        hidden_shape = (b, tokens.shape[1], stage.config.n_embd)
        events.clear()
        with record_p2p() as record:
            returned = run_stage(stage, list(actions), pieces, hidden_shape, shifted_cross_entropy)
        returned = returned.item() if isinstance(returned, torch.Tensor) else returned
        result["returned"].append(returned)
        result["events"].append(list(events))
        result["peak_in_flight"].append(peak_in_flight(events))
        result["sent"].append(record.sent)
        result["received"].append(record.received)
        return returned if returned is not None else 0.0

    try:
        for batch in global_batches(steps, global_batch, seq_len, seed):
            opt.zero_grad(set_to_none=True)
            train_step(stage, [batch], opt, forward_backward=forward_backward, after_backward=keep_first_grads,
                       grad_norm=False, zero_grad=False)
    finally:
        for handle in handles:
            handle.remove()
    result["params"] = {full_model_name(n): p.detach().cpu().clone() for n, p in stage.named_parameters()}
    return result


def stage_loop_reference(steps: int = 2, global_batch: int = 8, seq_len: int = 16, seed: int = 0, lr: float = 0.05,
                         config_overrides: dict | None = None) -> dict:
    """One process, the whole model and batch, SGD as check_stage_loop: first-step gradients, losses, parameters."""
    model = seeded_gpt(seed, "tiny", **(config_overrides or {}))
    return train_whole_batches(model, _optimizer(model.parameters(), "sgd", lr),
                               global_batches(steps, global_batch, seq_len, seed))

"""Rank workers for pipeline parallelism: train a GPT split into stages, one rank per stage.

    from course_lib.runtime.launch import launch
    from course_lib.pipeline_parallel.workers import pipeline_train, reference_run
    ranks = launch(pipeline_train, world_size=2, kwargs=dict(schedule="1f1b", micro_batches=4))
    reference = reference_run()                       # one process, the whole model and batch
    ranks = launch(bubble_sweep, world_size=2, kwargs=dict(micro_batch_counts=(1, 2, 4, 8)))

Rank workers that grade the pipeline exercise (Session E, notebook 02b): the learner's 1F1B schedule
running course_lib's pipeline (PipelineRunner) on real ranks.

    ranks = launch(check_schedule_on_ranks, 2, args=(spawnable(one_f_one_b),))
"""

from __future__ import annotations

import functools
import time
from unittest import mock

import torch
import torch.distributed as dist

from course_lib.core.steps import train_step
from course_lib.parity import global_batches, seeded_gpt, train_whole_batches
from course_lib.pipeline_parallel import schedules
from course_lib.pipeline_parallel.stage import (
    GPTStage,
    PipelineRunner,
    allreduce_tied_grad,
    broadcast_tied_weight,
    full_model_name,
    tied_weight_group,
)
from course_lib.runtime.env import get_dist_info

IMPLEMENTATIONS = ("scratch", "torch")


OPTIMIZERS = ("adamw", "sgd")


def _optimizer(params, name: str, lr: float):
    """AdamW as in the course's training runs. SGD with momentum for strict multi-step parity on deep splits:
    Adam's first update is lr * g / (|g| + eps), so a gradient of 1e-8 whose last bits differ (the pipeline
    adds micro-batches in another order) moves a weight by a visibly different amount; SGD's update is linear
    in g and keeps such differences as small as the gradients' own."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def reference_run(steps: int = 3, preset: str = "tiny", config_overrides: dict | None = None,
                  global_batch: int = 8, seq_len: int = 32, seed: int = 0, lr: float = 1e-3,
                  optimizer: str = "adamw") -> dict:
    """One process, the whole model, the whole global batch: first-step gradients, losses, final parameters."""
    model = seeded_gpt(seed, preset, **(config_overrides or {}))
    return train_whole_batches(model, _optimizer(model.parameters(), optimizer, lr),
                               global_batches(steps, global_batch, seq_len, seed))


def pipeline_train(schedule: str = "1f1b", steps: int = 3, micro_batches: int = 4, preset: str = "tiny",
                   config_overrides: dict | None = None, global_batch: int = 8, seq_len: int = 32, seed: int = 0,
                   lr: float = 1e-3, optimizer: str = "adamw", implementation: str = "scratch") -> dict:
    """Train this rank's stage for `steps` steps with `schedule`; `implementation` 'scratch'
    (course_lib.pipeline_parallel.stage) or 'torch' (torch.distributed.pipelining).

    Every rank builds the full model from the same seed and keeps its stage (a large model would be built
    on the meta device, stage by stage). Returns this rank's stage, first-step gradients and final
    parameters under the full model's names, losses (last stage), and per step: the timeline, the bytes sent,
    the peak micro-batches in flight and their saved-activation bytes (scratch only).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    info = get_dist_info()
    stage = GPTStage(seeded_gpt(seed, preset, **(config_overrides or {})), info.rank, info.world_size).to(info.device)
    group = tied_weight_group(info.world_size)
    broadcast_tied_weight(stage, group)
    opt = _optimizer(stage.parameters(), optimizer, lr)
    if implementation == "scratch":
        runner = PipelineRunner(stage, schedule, micro_batches)
        run_step = runner.step
    else:
        from course_lib.pipeline_parallel.torch_pipelining import build_torch_pipeline, torch_pipeline_step

        torch_schedule = build_torch_pipeline(stage, schedule, micro_batches)
        run_step = functools.partial(torch_pipeline_step, torch_schedule, stage)
    result = {"rank": info.rank, "stage": info.rank, "layers": list(stage.layers), "losses": [], "grads": None,
              "step_s": [], "timelines": [], "micro_batch_ids": [], "bytes_sent": [], "tied_grad_bytes": [],
              "peak_in_flight": [], "peak_activation_bytes": []}
    def tie_and_record():  # after the schedule's backward: sum the tied matrix's two gradients, note the step
        result["tied_grad_bytes"].append(allreduce_tied_grad(stage, group))
        result["step_s"].append(time.monotonic() - start)
        if result["grads"] is None:
            result["grads"] = {full_model_name(n): p.grad.cpu().clone() for n, p in stage.named_parameters()}

    for batch in global_batches(steps, global_batch, seq_len, seed):
        opt.zero_grad(set_to_none=True)
        dist.barrier()  # every stage starts the step together: the timelines share an origin
        start = time.monotonic()
        loss = train_step(stage, [batch], opt, forward_backward=lambda micro_batches: run_step(micro_batches[0]),
                          after_backward=tie_and_record, grad_norm=False)["loss"]
        if loss is not None:
            result["losses"].append(loss)
        if implementation == "scratch":  # torch's schedules do not expose what the runner records
            for key, value in (("timelines", runner.timeline), ("micro_batch_ids", runner.micro_batch_ids),
                               ("bytes_sent", runner.bytes_sent), ("peak_in_flight", runner.peak_in_flight),
                               ("peak_activation_bytes", runner.peak_activation_bytes)):
                result[key].append(value)
    result["params"] = {full_model_name(n): p.detach().cpu().clone() for n, p in stage.named_parameters()}
    dist.barrier()
    return result


def bubble_sweep(micro_batch_counts=(1, 2, 4, 8), schedules=("gpipe", "1f1b"), steps: int = 4,
                 micro_batch_size: int = 2, preset: str = "small", seq_len: int = 128, seed: int = 0) -> dict:
    """Step timelines for every (schedule, m): the micro-batch size is fixed, so the global batch is m of them.

    The variants take turns step by step (A B A B ...) after one warm-up step each, so a slow moment of the
    machine hits them all. Returns this rank's blocks, torch threads and records: {(schedule, m): {"timelines":
    [one per timed step], "micro_batch_ids": [...], "peak_in_flight": n, "peak_activation_bytes": bytes}}.
    """
    info = get_dist_info()
    stage = GPTStage(seeded_gpt(seed, preset), info.rank, info.world_size).to(info.device)
    # The schedules of one m see the same batches; every step a new one of m micro-batches.
    batches = {m: global_batches(steps + 1, m * micro_batch_size, seq_len, seed, stage.config.vocab_size)
               for m in micro_batch_counts}
    variants = {(name, m): PipelineRunner(stage, name, m) for name in schedules for m in micro_batch_counts}
    records = {key: {"timelines": [], "micro_batch_ids": [], "peak_in_flight": 0, "peak_activation_bytes": 0}
               for key in variants}
    for step in range(steps + 1):
        for (name, m), runner in variants.items():
            tokens = batches[m][step]
            stage.zero_grad(set_to_none=True)
            dist.barrier()
            runner.step(tokens)
            if step == 0:
                continue  # warm-up: first calls allocate buffers and fill caches
            record = records[(name, m)]
            record["timelines"].append(runner.timeline)
            record["micro_batch_ids"].append(runner.micro_batch_ids)
            record["peak_in_flight"] = runner.peak_in_flight
            record["peak_activation_bytes"] = runner.peak_activation_bytes
    dist.barrier()
    return {"rank": info.rank, "layers": list(stage.layers), "threads": torch.get_num_threads(), "records": records}


def check_schedule_on_ranks(schedule_fn, *, micro_batches: int = 4, steps: int = 2, seed: int = 0) -> dict:
    """Worker: train this rank's stage with schedule_fn as the '1f1b' schedule (pipeline_train, scratch runner)."""
    with mock.patch.dict(schedules.SCHEDULES, {"1f1b": schedule_fn}):
        return pipeline_train(schedule="1f1b", steps=steps, micro_batches=micro_batches, seed=seed,
                              implementation="scratch")

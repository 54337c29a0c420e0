"""The same pipeline with torch.distributed.pipelining: PipelineStage plus ScheduleGPipe or Schedule1F1B.

The stage modules are course_lib.pipeline_parallel.stage.GPTStage (cut by hand, no tracing); torch takes over what
course_lib.pipeline_parallel.stage.PipelineRunner does by hand: splitting the batch into micro-batches, the
send/recv of activations and gradients (with shapes exchanged on the first step), the order of forwards and
backwards, and dividing the gradients by the number of micro-batches. The tied embedding is still ours to handle.

    from course_lib.runtime.launch import launch
    from course_lib.pipeline_parallel.workers import pipeline_train
    ranks = launch(pipeline_train, world_size=2, kwargs=dict(schedule="1f1b", implementation="torch"))
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from course_lib.pipeline_parallel.stage import GPTStage, shifted_cross_entropy

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_torch_pipeline(stage: GPTStage, schedule: str, micro_batches: int):
    """Wrap this rank's stage module for torch's pipelining runtime; returns the schedule object.

    shifted_cross_entropy is a per-micro-batch mean and the schedule divides the accumulated gradients
    by micro_batches (scale_grads=True), so the result is the gradient of the global batch's mean loss.
    """
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(TORCH_SCHEDULES)}, got {schedule!r}")
    if schedule == "1f1b" and micro_batches < stage.n_stages:
        raise ValueError(f"Schedule1F1B needs micro_batches >= number of stages, got {micro_batches} micro-batches "
                         f"for {stage.n_stages} stages")
    device = next(stage.parameters()).device  # the stage module is already where it runs
    pipeline_stage = PipelineStage(stage, stage.stage, stage.n_stages, device)
    return TORCH_SCHEDULES[schedule](pipeline_stage, n_microbatches=micro_batches, loss_fn=shifted_cross_entropy,
                                     scale_grads=True)


def torch_pipeline_step(schedule, stage: GPTStage, tokens: torch.Tensor) -> float | None:
    """One forward + backward of the (B, T) global batch: stage 0 feeds the tokens in, the last stage uses them
    as targets and returns the batch loss (mean of the micro-batch losses); the others return None."""
    if tokens.shape[0] % schedule._n_microbatches:
        raise ValueError(f"a global batch of {tokens.shape[0]} sequences cannot be split into "
                         f"{schedule._n_microbatches} equal micro-batches")
    tokens = tokens.to(next(stage.parameters()).device)
    args = (tokens,) if stage.is_first else ()
    if not stage.is_last:
        schedule.step(*args)
        return None
    losses: list[torch.Tensor] = []
    schedule.step(*args, target=tokens, losses=losses)
    return torch.stack(losses).mean().item()

"""Rank workers for ZeRO: every stage against torch DDP and one process, per-rank memory, traffic.

Each function runs inside every rank of a course_lib.runtime.launch job (spawned ranks import their worker by name):

    from course_lib.runtime.launch import launch
    from course_lib.sharding.zero_workers import reference_run, zero_parity_run
    ranks = launch(zero_parity_run, 2, kwargs=dict(stages=(1, 2, 3), steps=3))   # one dict per rank
    reference = reference_run(steps=3)                                            # one process, same batches

The model is the tiny preset with n_embd=66, n_head=3 (MODEL_OVERRIDES): 102,762 parameters, which is not a
multiple of 4, so the padding rule of course_lib.sharding.zero shows at world size 4.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.model import GPT
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.runtime.env import get_dist_info
from course_lib.sharding import apply_zero
from course_lib.sharding.model_states import live_bytes, measure_model_states
from course_lib.sharding.zero import ZeroAdamW
from course_lib.parity import global_batches, local_rows, seeded_gpt, train_whole_batches

MODEL_PRESET = "tiny"
MODEL_OVERRIDES = {"n_embd": 66, "n_head": 3}
TRAINING = dict(lr=1e-3, weight_decay=0.1)  # configure_optimizer's betas (0.9, 0.95) and eps 1e-8 on both sides


def make_model(seed: int = 0) -> GPT:
    """The model of every ZeRO check (MODEL_PRESET with MODEL_OVERRIDES), seeded."""
    return seeded_gpt(seed, MODEL_PRESET, **MODEL_OVERRIDES)


def _my_rows(batch: torch.Tensor) -> torch.Tensor:
    info = get_dist_info()
    return local_rows(batch, info.rank, info.world_size).to(info.device)


def _cpu(params: dict) -> dict:
    return {name: tensor.detach().cpu().clone() for name, tensor in params.items()}


def reference_run(steps: int = 3, global_batch: int = 8, seq_len: int = 32, seed: int = 0) -> dict:
    """One process, the whole global batch, torch.optim.AdamW over course_lib.core.optim's parameter groups."""
    model = make_model(seed)
    return train_whole_batches(model, configure_optimizer(model, **TRAINING),
                               global_batches(steps, global_batch, seq_len, seed))


def ddp_run(steps: int = 3, global_batch: int = 8, seq_len: int = 32, seed: int = 0) -> dict:
    """torch DDP + torch AdamW on this rank's rows; memory measured right after the last optimizer step.

    gradient_as_bucket_view=True makes each .grad a view into DDP's communication buckets, so counting the
    .grad storages counts the gradient memory DDP really holds (otherwise it keeps a second copy in them).
    """
    info = get_dist_info()
    model = make_model(seed + info.rank).to(info.device)  # different per rank: DDP's broadcast must fix it
    wrapped = DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                                      gradient_as_bucket_view=True)
    optimizer = configure_optimizer(model, **TRAINING)
    losses = []
    for batch in global_batches(steps, global_batch, seq_len, seed):
        optimizer.zero_grad(set_to_none=True)
        # the gradients stay after the step: the memory below counts them
        losses.append(train_step(wrapped, [_my_rows(batch)], optimizer, grad_norm=False, zero_grad=False)["loss"])
    return {"params": _cpu(dict(model.named_parameters())), "losses": losses,
            "memory": measure_model_states(model, optimizer),
            "step_counters": sum(1 for s in optimizer.state.values() if "step" in s)}


def zero_run(stage: int, precision: str = "fp32", steps: int = 3, global_batch: int = 8, seq_len: int = 32,
             seed: int = 0) -> dict:
    """ZeRO `stage` on this rank's rows. Returns the full parameters after `steps` steps (gathered for
    stage 3), the local losses, the model-state bytes this rank holds right after the last step, the
    communication volume of the last step (elements, ZeRO paper accounting), the step times, and two
    transient peaks: full gradients alive at once during backward (stage 2 and 3 free each one as soon
    as it is reduce-scattered) and, for stage 3, full parameters gathered at once."""
    info = get_dist_info()
    model = make_model(seed + info.rank).to(info.device)  # different per rank: ZeRO's broadcast must fix it
    peak = {"grads": 0}

    def full_gradients_alive(param):  # registered before ZeRO's hooks, so it runs before they free .grad
        peak["grads"] = max(peak["grads"], live_bytes(p.grad for p in model.parameters() if p.grad is not None))

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(full_gradients_alive)
    zero = apply_zero(model, stage, precision=precision, **TRAINING)
    optimizer = ZeroAdamW(zero, TRAINING["lr"])
    losses, times = [], []
    for batch in global_batches(steps, global_batch, seq_len, seed):
        for kind in zero.comm_volume:
            zero.comm_volume[kind] = 0
        start = time.perf_counter()
        zero.zero_grad()
        # what ZeRO holds after the step is measured below: the step leaves it as it is
        stats = train_step(model, [_my_rows(batch)], optimizer, grad_norm=False, zero_grad=False)
        times.append(time.perf_counter() - start)
        losses.append(stats["loss"])
    memory = measure_model_states(model, None, extra=zero.state_tensors())
    return {"stage": stage, "precision": precision, "params": _cpu(zero.full_parameters()), "losses": losses,
            "memory": memory, "comm_volume": dict(zero.comm_volume), "n_params": zero.layout.numel,
            "step_times": times, "peak_gathered_bytes": getattr(zero, "peak_gathered_bytes", None),
            "peak_full_grad_bytes": peak["grads"]}


def zero_parity_run(stages=(0, 1, 2, 3), precisions=("fp32",), steps: int = 3, **kwargs) -> dict:
    """torch DDP, then every (stage, precision) in turn, in the same ranks (one launch instead of many).

    Returns {"ddp": ddp_run(...), (stage, precision): zero_run(...), ..., "rank", "world_size"}.
    """
    info = get_dist_info()
    results = {"rank": info.rank, "world_size": info.world_size, "ddp": ddp_run(steps, **kwargs)}
    for precision in precisions:
        for stage in stages:
            results[(stage, precision)] = zero_run(stage, precision, steps, **kwargs)
            dist.barrier()
    return results

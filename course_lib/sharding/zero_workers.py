"""Rank workers for ZeRO: every stage against torch DDP and one process, per-rank memory, traffic.

Each function runs inside every rank of a course_lib.runtime.launch job (spawned ranks import their worker by name):

    from course_lib.runtime.launch import launch
    from course_lib.sharding.zero_workers import reference_run, zero_parity_run
    ranks = launch(zero_parity_run, 2, kwargs=dict(stages=(1, 2, 3), steps=3))   # one dict per rank
    reference = reference_run(steps=3)                                            # one process, same batches

The model is the tiny preset with n_embd=66, n_head=3 (MODEL_OVERRIDES): 102,762 parameters, which is not a
multiple of 4, so the padding rule of course_lib.sharding.zero shows at world size 4.

Rank workers that grade the ZeRO exercises (Session D, notebook 02b): the learner's stage on every rank.

    ranks = launch(check_zero, 2, args=(spawnable(zero1_optimizer),), kwargs={"stage": 1})
    ranks = launch(check_zero3_forward, 3, args=(spawnable(zero3_shard),))

check_zero trains identical replicas with the learner's optimizer (SGD with momentum, so there is optimizer
state to shard) and records the collectives it calls, where the momentum lives and which full gradients are
alive after backward; zero_reference is the same training in one process. check_zero3_forward shards a
small MLP with the learner's hooks and records what is gathered while each layer runs.
"""

from __future__ import annotations

import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.model import GPT
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.data_parallel.collective_gate import process_group_calls
from course_lib.parity import global_batches, local_rows, seeded_gpt, train_whole_batches
from course_lib.runtime.env import get_dist_info
from course_lib.sharding import apply_zero
from course_lib.sharding.model_states import live_bytes, measure_model_states
from course_lib.sharding.zero import ZeroAdamW

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


REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
ZERO_PRESET = {"n_embd": 66, "n_head": 3}
"""The tiny GPT with 102,762 parameters: not a multiple of 2, 3 or 4, so the flat vector is padded."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def zero_model(seed: int = 0):
    return seeded_gpt(seed, "tiny", **ZERO_PRESET)


ALL_REDUCE_REFUSAL = ("ZeRO replaces DDP's all-reduce by a reduce-scatter of the gradients and an all-gather of the "
                      "parameters: do not call dist.all_reduce")


class _GatePatch:
    """course_lib.data_parallel.collective_gate.process_group_calls, started and stopped like a mock patch."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self._context = kwargs, [], None

    def start(self):
        self._context = process_group_calls(**self.kwargs)
        self.calls = self._context.__enter__()

    def stop(self):
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


class _Recorder:
    """Wraps torch.distributed's collectives and torch.optim.SGD for one worker."""

    def __init__(self):
        self.calls: list[dict] = []
        self.optimizers: list[torch.optim.Optimizer] = []

    def patches(self):
        real = {name: getattr(dist, name) for name in REDUCE_SCATTERS + ALL_GATHERS if hasattr(dist, name)}  # *_single: torch >= 2.12

        def wrap(name):
            def collective(output, input, *args, **kwargs):
                numel = lambda t: sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()  # noqa: E731
                self.calls.append({"kind": "reduce_scatter" if name in REDUCE_SCATTERS else "all_gather",
                                   "output": numel(output), "input": numel(input), "in_backward": _in_backward()})
                return real[name](output, input, *args, **kwargs)
            return collective

        def refuse(*args, **kwargs):
            raise RuntimeError(ALL_REDUCE_REFUSAL)

        recorder, real_sgd = self, torch.optim.SGD

        class RecordingSGD(real_sgd):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                recorder.optimizers.append(self)

        self.gate = _GatePatch(refused=("allreduce",), reason=ALL_REDUCE_REFUSAL)  # by whatever road it is reached
        return ([mock.patch.object(dist, name, wrap(name)) for name in real]
                + [mock.patch.object(dist, "all_reduce", refuse), mock.patch.object(torch.optim, "SGD", RecordingSGD),
                   self.gate])

    def unrecorded(self) -> str | None:
        """Why the recorded calls are not all that went over the network, or None: an all-gather or
        reduce-scatter that reached the process group by another road than dist's functions is not counted."""
        seen = [call for call in self.gate.calls if call.kind in ("allgather", "reduce_scatter")]
        if len(seen) > len(self.calls):
            names = sorted({call.name for call in seen})
            return (f"RuntimeError: {len(seen) - len(self.calls)} all-gathers or reduce-scatters ran without "
                    f"dist.{', dist.'.join(REDUCE_SCATTERS[:1] + ALL_GATHERS[:1])} or the other names of "
                    f"torch.distributed (they reached {', '.join(names)}): call torch.distributed's functions, so "
                    "that the check can count them")
        return None

    def momentum_numel(self) -> int:
        return sum(state["momentum_buffer"].numel() for opt in self.optimizers for state in opt.state.values()
                   if state.get("momentum_buffer") is not None)


def check_zero(zero_fn, *, stage: int, steps: int = 3, lr: float = 0.1, momentum: float = 0.9,
               rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """Worker: step = zero_fn(model, lr, momentum), then `steps` of (zero_grad, backward on this rank's rows,
    step()). Returns the final parameters and, per step, the collectives called and the full gradients
    alive between backward and step; plus the momentum elements this rank keeps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = zero_model(seed)
    recorder = _Recorder()
    patches = recorder.patches()
    for patch in patches:
        patch.start()
    records = []
    try:
        step = zero_fn(model, lr, momentum)
        if not callable(step):
            raise TypeError(f"return the step() function, got {step!r}")
        for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
            model.zero_grad(set_to_none=True)
            rows = local_rows(batch, rank, world_size)
            first = len(recorder.calls)
            model(rows, targets=rows)[1].backward()
            full_grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
            middle = len(recorder.calls)
            step()
            records.append({"backward_calls": recorder.calls[first:middle], "step_calls": recorder.calls[middle:],
                            "full_grad_numel_after_backward": full_grads})
        error = None
    except Exception as err:  # noqa: BLE001 (reported to the test cell)
        error = f"{type(err).__name__}: {err}"
    finally:
        for patch in patches:
            patch.stop()
    error = error or recorder.unrecorded()
    return {"rank": rank, "world_size": world_size, "stage": stage, "error": error, "steps": records,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "momentum_numel": recorder.momentum_numel(), "n_params": sum(p.numel() for p in model.parameters())}


def zero_reference(world_size: int, *, steps: int = 3, lr: float = 0.1, momentum: float = 0.9,
                   rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """One process, whole batches, torch.optim.SGD with momentum: the parameters every rank must end with."""
    model = zero_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
        train_step(model, [batch], optimizer, grad_norm=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def zero3_mlp(seed: int = 0) -> nn.Sequential:
    """Three linear layers of different sizes (7, 13, 5 outputs: no size divides by 2 or 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))


def check_zero3_forward(shard_fn, *, seed: int = 0, passes: int = 2) -> dict:
    """Worker: shard_fn(model) on every rank, then `passes` forward passes on this rank's inputs.

    Returns the outputs next to a full copy's, the parameter elements materialised before, during (seen from
    each layer's forward) and after the passes, and the all-gathers called.
    """
    rank = dist.get_rank()
    model, full = zero3_mlp(seed), zero3_mlp(seed)
    linears = [m for m in model if isinstance(m, nn.Linear)]

    def materialised() -> int:
        """Elements of the layers' parameters that have memory right now (a freed storage holds none)."""
        return sum(p.untyped_storage().nbytes() // p.element_size() for m in linears for p in m.parameters())

    recorder = _Recorder()
    patches = recorder.patches()
    result = {"rank": rank, "error": None, "outputs": [], "expected": [], "during": []}
    for patch in patches:
        patch.start()
    try:
        shard_fn(model)
        result["after_sharding"] = materialised()
        for layer in linears:  # registered after the learner's hooks, so it sees what they left
            layer.register_forward_pre_hook(lambda module, args: result["during"].append(materialised()))
        generator = torch.Generator().manual_seed(seed * 10 + rank)
        for _ in range(passes):
            x = torch.randn(4, 6, generator=generator)
            with torch.no_grad():
                result["outputs"].append(model(x))
                result["expected"].append(full(x))
        result["after_forward"] = materialised()
    except Exception as err:  # noqa: BLE001 (reported to the test cell)
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        for patch in patches:
            patch.stop()
    result["error"] = result["error"] or recorder.unrecorded()
    result["calls"] = recorder.calls
    result["full_numel"] = sum(p.numel() for p in full.parameters())
    result["layer_numels"] = [[p.numel() for p in m.parameters()] for m in full if isinstance(m, nn.Linear)]
    return result

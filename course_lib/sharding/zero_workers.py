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
    ranks = launch(check_zero3, 3, args=(spawnable(zero3_optimizer),), kwargs={"steps": 4})

check_zero trains identical replicas with the learner's optimizer (SGD with momentum, so there is optimizer
state to shard) and records the collectives it calls, where the momentum lives and which full gradients are
alive after backward; zero_reference is the same training in one process. check_zero3 trains a stack of four
MLP units (zero3_model) with the learner's ZeRO-3 and records, in order, each unit's entry and exit, the moment
its gradients are complete and every collective, and the most bytes of full weights alive at once (every
storage an all-gather wrote into, while anything, autograd's saved tensors included, still holds it);
zero3_reference trains it in one process.
"""

from __future__ import annotations

import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
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


class _RecordedWork:
    """The work object of an asynchronous collective, recording where wait() is called (in backward or not)."""

    def __init__(self, work, call: dict, events: list, index: int):
        self._work, self._call, self._events, self._index = work, call, events, index
        call["waited_in_backward"] = None

    def wait(self, *args, **kwargs):
        self._call["waited_in_backward"] = bool(self._call["waited_in_backward"]) or _in_backward()  # any wait
        self._events.append(("wait", self._index))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class _Recorder:
    """Wraps torch.distributed's collectives and torch.optim.SGD for one worker."""

    def __init__(self):
        self.calls: list[dict] = []
        self.events: list[tuple] = []   # ("call", index into calls) among the events a worker adds
        self.gathered: list[StorageWeakRef] = []  # the storages the all-gathers wrote into
        self.on_call = None                    # called after each recorded collective starts
        self.optimizers: list[torch.optim.Optimizer] = []

    def patches(self):
        real = {name: getattr(dist, name) for name in REDUCE_SCATTERS + ALL_GATHERS if hasattr(dist, name)}  # *_single: torch >= 2.12

        def wrap(name):
            def collective(output, input, *args, **kwargs):
                numel = lambda t: sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()  # noqa: E731
                self.calls.append({"kind": "reduce_scatter" if name in REDUCE_SCATTERS else "all_gather",
                                   "output": numel(output), "input": numel(input), "in_backward": _in_backward(),
                                   "async": bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))})
                self.events.append(("call", len(self.calls) - 1))
                work = real[name](output, input, *args, **kwargs)
                if work is not None:  # async_op=True: record where it is waited for
                    work = _RecordedWork(work, self.calls[-1], self.events, len(self.calls) - 1)
                if name in ALL_GATHERS:  # what it gathers into is parameter memory while anything holds it
                    outputs = output if isinstance(output, (list, tuple)) else [output]
                    self.gathered.extend(StorageWeakRef(t.untyped_storage()) for t in outputs)
                if self.on_call is not None:
                    self.on_call()
                return work
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
               rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0, options: dict | None = None) -> dict:
    """Worker: step = zero_fn(model, lr, momentum, **options), then `steps` of (zero_grad, backward on this
    rank's rows, step()). Returns the final parameters and, per step, the collectives called, the events of
    backward in order (("grad",) when a parameter's gradient is complete, ("call", i) for calls[i]) and the
    full gradients alive between backward and step; plus the momentum elements this rank keeps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = zero_model(seed)
    recorder = _Recorder()
    for param in model.parameters():  # registered before the learner's hooks: they run first
        param.register_post_accumulate_grad_hook(lambda param: recorder.events.append(("grad",)))
    patches = recorder.patches()
    for patch in patches:
        patch.start()
    records = []
    try:
        step = zero_fn(model, lr, momentum, **(options or {}))
        if not callable(step):
            raise TypeError(f"return the step() function, got {step!r}")
        for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
            model.zero_grad(set_to_none=True)
            rows = local_rows(batch, rank, world_size)
            first, first_event = len(recorder.calls), len(recorder.events)
            model(rows, targets=rows)[1].backward()
            backward_events = [(e[0], e[1] - first) if e[0] in ("call", "wait") else e
                               for e in recorder.events[first_event:]]
            full_grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
            middle = len(recorder.calls)
            step()
            records.append({"backward_calls": recorder.calls[first:middle], "step_calls": recorder.calls[middle:],
                            "full_grad_numel_after_backward": full_grads, "backward_events": backward_events})
        error = None
    except Exception as err:  # noqa: BLE001 (reported to the test cell)
        error = f"{type(err).__name__}: {err}"
    finally:
        for patch in patches:
            patch.stop()
    error = error or recorder.unrecorded()
    return {"rank": rank, "world_size": world_size, "stage": stage, "error": error, "steps": records,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "momentum_numel": recorder.momentum_numel(), "n_params": sum(p.numel() for p in model.parameters()),
            "param_numels": [p.numel() for p in model.parameters()]}


def zero_reference(world_size: int, *, steps: int = 3, lr: float = 0.1, momentum: float = 0.9,
                   rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """One process, whole batches, torch.optim.SGD with momentum: the parameters every rank must end with."""
    model = zero_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
        train_step(model, [batch], optimizer, grad_norm=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


ZERO3_UNITS = ((8, 23, 12), (12, 19, 12), (12, 29, 10), (10, 15, 6))
"""(in, hidden, out) of each unit of the ZeRO-3 model: Linear, GELU, Linear. 495, 487, 677 and 261 parameters:
none divides by 2 or 4 (495 divides by 3), so on 2 or 4 ranks every unit's flat vector is padded."""


def zero3_model(seed: int = 0) -> nn.Sequential:
    """The model of the ZeRO-3 exercise: a stack of four MLP units of different sizes (ZERO3_UNITS)."""
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))
                           for d_in, hidden, d_out in ZERO3_UNITS))


def zero3_batches(steps: int, rows: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 1000)
    return [(torch.randn(rows, ZERO3_UNITS[0][0], generator=generator),
             torch.randn(rows, ZERO3_UNITS[-1][-1], generator=generator)) for _ in range(steps)]


def zero3_unit_bytes(world_size: int) -> list[int]:
    """Bytes of each unit's full, padded flat parameters at `world_size` (fp32): N * ceil(n_u / N) * 4."""
    numels = [sum(p.numel() for p in unit.parameters()) for unit in zero3_model()]
    return [-(-n // world_size) * world_size * 4 for n in numels]


def _live_bytes(params, gathered: list[StorageWeakRef]) -> int:
    """Bytes of full parameters that exist now: the storages the all-gathers wrote into that something still holds
    (a parameter, a prefetch in flight, or a tensor autograd saved for backward), at their current size (a
    storage resized to 0 holds none), and any other storage a parameter holds. Each storage counted once."""
    sizes = {}
    for ref in gathered:
        if not ref.expired():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage.nbytes():
                sizes[storage.data_ptr()] = storage.nbytes()
    for p in params:
        storage = p.untyped_storage()
        if storage.nbytes():
            sizes[storage.data_ptr()] = storage.nbytes()
    gathered[:] = [ref for ref in gathered if not ref.expired()]
    return sum(sizes.values())


def check_zero3(zero_fn, *, steps: int = 3, lr: float = 0.05, momentum: float = 0.9, rows_per_rank: int = 4,
                seed: int = 0) -> dict:
    """Worker: step = zero_fn(model, lr, momentum) on the ZeRO-3 model, then `steps` of (forward and MSE loss on
    this rank's rows, backward, step()), then one forward without gradients that captures the full parameters.

    Returns the losses, the captured parameters, the momentum this rank keeps (its SGD's buffers, in order),
    the parameter bytes gathered at rest and the most gathered at once (sampled at every unit's entry and
    exit, at every gradient and every collective), and per step the events in order: ("enter"|"leave", unit),
    ("grad_done", unit) when a unit's last gradient is complete, ("call", i) for calls[i] and ("wait", i) when
    the work of an asynchronous calls[i] is waited for.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = zero3_model(seed)
    units = list(model.children())
    params = list(model.parameters())
    shapes = {id(p): tuple(p.shape) for p in params}
    recorder = _Recorder()
    result = {"rank": rank, "world_size": world_size, "error": None, "losses": [], "steps": [], "peak_bytes": 0,
              "unit_bytes": zero3_unit_bytes(world_size), "full_shapes_while_running": True}

    def live() -> int:
        return _live_bytes(params, recorder.gathered)

    def sample():
        result["peak_bytes"] = max(result["peak_bytes"], live())

    recorder.on_call = sample
    for i, unit in enumerate(units):  # registered before the learner's hooks: they run first
        remaining = {"n": 0}

        def gradient(param, i=i, unit=unit, remaining=remaining):
            sample()
            remaining["n"] = remaining["n"] or len(list(unit.parameters()))
            remaining["n"] -= 1
            if remaining["n"] == 0:
                recorder.events.append(("grad_done", i))

        for param in unit.parameters():
            param.register_post_accumulate_grad_hook(gradient)
    patches = recorder.patches()
    for patch in patches:
        patch.start()
    try:
        step = zero_fn(model, lr, momentum)
        if not callable(step):
            raise TypeError(f"return the step() function, got {step!r}")
        result["bytes_at_rest"] = [live()]
        captured = {}

        for i, unit in enumerate(units):
            def enter(module, args, i=i):  # after the learner's pre-hooks: the unit must be gathered now
                sample()
                recorder.events.append(("enter", i))
                if any(tuple(p.shape) != shapes[id(p)] for p in module.parameters()):
                    result["full_shapes_while_running"] = False
                if "on" in captured:
                    captured.update({f"{i}.{n}": p.detach().clone() for n, p in module.named_parameters()})

            def leave(module, args, output, i=i):  # before the learner's forward hooks
                sample()
                recorder.events.append(("leave", i))

            unit.register_forward_pre_hook(enter)
            unit.register_forward_hook(leave, prepend=True)
        for x, y in zero3_batches(steps, rows_per_rank * world_size, seed):
            first_event = len(recorder.events)
            rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
            loss = F.mse_loss(model(x[rows]), y[rows])
            forward_end = len(recorder.events)
            loss.backward()
            backward_end = len(recorder.events)
            step()
            result["losses"].append(loss.item())
            result["bytes_at_rest"].append(live())
            result["steps"].append({"forward": recorder.events[first_event:forward_end],
                                    "backward": recorder.events[forward_end:backward_end],
                                    "step": recorder.events[backward_end:]})
            sample()
        captured["on"] = True
        with torch.no_grad():
            model(zero3_batches(1, 1, seed)[0][0])
        captured.pop("on")
        result["params"] = captured
        result["bytes_at_rest"].append(live())
    except Exception as err:  # noqa: BLE001 (reported to the test cell)
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        for patch in patches:
            patch.stop()
    result["error"] = result["error"] or recorder.unrecorded()
    result["calls"] = recorder.calls
    result["momentum"] = [state["momentum_buffer"].detach().clone() for opt in recorder.optimizers
                          for group in opt.param_groups for p in group["params"]
                          if (state := opt.state.get(p, {})).get("momentum_buffer") is not None]
    return result


def zero3_reference(world_size: int, *, steps: int = 3, lr: float = 0.05, momentum: float = 0.9,
                    rows_per_rank: int = 4, seed: int = 0) -> dict:
    """One process, whole batches, torch.optim.SGD with momentum on the ZeRO-3 model: the losses, the parameters
    ("unit.name") and each rank's expected momentum: per unit, its slice of the padded flat momentum."""
    model = zero3_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    def forward_backward(micro_batches):
        (x, y), = micro_batches
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for x, y in zero3_batches(steps, rows_per_rank * world_size, seed):
        losses.append(train_step(model, [(x, y)], optimizer, forward_backward=forward_backward, grad_norm=False)["loss"])
    shards = {r: [] for r in range(world_size)}
    for unit in model:
        flat = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in unit.parameters()])
        size = -(-flat.numel() // world_size)
        flat = F.pad(flat, (0, size * world_size - flat.numel()))
        for r in range(world_size):
            shards[r].append(flat[r * size:(r + 1) * size])
    return {"losses": losses, "momentum": {r: torch.cat(pieces) for r, pieces in shards.items()},
            "params": {f"{i}.{n}": p.detach().clone() for i, unit in enumerate(model)
                       for n, p in unit.named_parameters()}}

"""Rank worker of `make bench`'s sharding section: what DDP, ZeRO-1/2/3 and FSDP hold per rank, and how long
a step takes, all trained in the same ranks and taking turns step by step.

    from course_lib.runtime.launch import launch
    from course_tools.bench.sharding_workers import sharding_bench
    ranks = launch(sharding_bench, 2, kwargs=dict(preset="tiny", steps=3), threads_per_rank=1)
    ranks[0]["strategies"]["ZeRO-2"]["memory"]      # bytes rank 0 holds right after its last optimizer step

    .venv/bin/python scripts/bench.py --only sharding        # the table, at 2 and 4 ranks

Every strategy wraps its own copy of the same model (same seed) with the course's code: torch DDP and FSDP2
(course_lib.sharding.fsdp.apply_fsdp) with torch AdamW over course_lib.core.optim's groups; ZeRO-1/2/3 with
course_lib.sharding.apply_zero (its flat-shard AdamW). Each round, every strategy trains one step on this rank's
rows of the same global batch, in an order that changes every round so that each strategy runs right after
every other equally often (course_lib.observability.timing.williams_orders); all of them see the same stretches
of machine load.

Memory is counted by course_lib.sharding.model_states.measure_model_states right after the last optimizer step and
predicted by expected_model_states (DDP, ZeRO) or course_lib.sharding.fsdp.expected_fsdp_model_states (FSDP). In the
last warm-up round a PeakProbe also records the most parameter and gradient bytes held at once during forward
and backward: the gathered units of ZeRO-3 and FSDP and the full gradients ZeRO-2/3 free one by one.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.model import GPTConfig
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.observability.timing import williams_orders
from course_lib.runtime.env import get_dist_info
from course_lib.sharding import ZeroAdamW, apply_zero
from course_lib.sharding.fsdp import expected_fsdp_model_states, apply_fsdp
from course_lib.sharding.model_states import expected_model_states, live_bytes, measure_model_states
from course_lib.sharding.zero_workers import TRAINING
from course_lib.parity import global_batches, local_rows, seeded_gpt

DATA_PARALLEL_STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP FULL_SHARD", "FSDP SHARD_GRAD_OP")
ZERO_STAGES = {"ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}


def _output_tensors(output) -> list[torch.Tensor]:
    items = output if isinstance(output, (tuple, list)) else [output]
    return [t for t in items if torch.is_tensor(t) and t.requires_grad]


class PeakProbe:
    """The most bytes of parameters, and of gradients, this rank holds at once during forward and backward.

    Samples at every leaf module's forward (before and after it), just before its backward (a hook on its
    output's gradient), and whenever a parameter's gradient has been accumulated (registered here, before a
    wrapper's own hooks, so it sees a full gradient before ZeRO-2/3 reduce-scatter and free it). Counted:
    the model's parameters as they are registered at that moment (FSDP swaps in the gathered ones), the
    at-rest tensors given to `watch` (FSDP's shards, ZeRO's shards), and the gradients of all of them, each
    storage once (course_lib.sharding.model_states.live_bytes). Not counted: activations, the autograd engine's
    gradient buffers, and temporaries inside the optimizer step (e.g. ZeRO-1/2's all-gather buffer).
    """

    def __init__(self, model: nn.Module):
        self.model, self.active, self.handles = model, False, []
        self.rest_params: list[torch.Tensor] = []
        self.rest_grads: list[torch.Tensor] = []
        self.peak = {"params": 0, "grads": 0}
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda param: self.sample())

    def watch(self, params=(), grads=()) -> None:
        """Tensors held outside the model's registered parameters (shards), counted at every sample."""
        self.rest_params, self.rest_grads = list(params), list(grads)

    def sample(self) -> None:
        if not self.active:
            return
        params = list(self.model.parameters()) + self.rest_params
        seen: set[int] = set()
        self.peak["params"] = max(self.peak["params"], live_bytes(params, seen))
        grads = [p.grad for p in params if p.grad is not None] + self.rest_grads
        self.peak["grads"] = max(self.peak["grads"], live_bytes(grads, seen))

    def _after_forward(self, module, args, output) -> None:
        self.sample()
        for tensor in _output_tensors(output):
            tensor.register_hook(lambda grad: self.sample())  # returns None: the gradient is unchanged

    def start(self) -> None:
        leaves = [m for m in self.model.modules() if not list(m.children())]
        for module in leaves:
            # Registered after the wrappers' hooks: the pre-hook sees what ZeRO-3/FSDP gathered for this module.
            self.handles.append(module.register_forward_pre_hook(lambda module, args: self.sample()))
            self.handles.append(module.register_forward_hook(self._after_forward))
        self.active = True

    def stop(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.active = [], False


class Trainee:
    """One strategy's model, optimizer step, and memory: measured (this rank) and predicted by its formula."""

    def __init__(self, name: str, config: GPTConfig, seed: int, world_size: int, rank: int):
        if name not in DATA_PARALLEL_STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; choose from {list(DATA_PARALLEL_STRATEGIES)}")
        self.name = name
        self.model = model = seeded_gpt(seed, config=config)
        self.probe = PeakProbe(model)  # before wrapping: its gradient hooks must run before ZeRO's
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in trainable)
        self.zero = self.optimizer = None
        self.forward = model
        if name in ZERO_STAGES:
            self.zero = apply_zero(model, ZERO_STAGES[name], **TRAINING)
            self.optimizer = ZeroAdamW(self.zero, TRAINING["lr"])  # ZeRO driven by core.steps.train_step
            extra = self.zero.state_tensors()
            self.probe.watch(extra["params"], extra["grads"])
            self.expected = expected_model_states(self.n_params, world_size, ZERO_STAGES[name])
        elif name == "DDP":
            # .grad as views into DDP's buckets: counting .grad counts the gradient memory DDP really holds.
            self.forward = DistributedDataParallel(model, gradient_as_bucket_view=True)
            self.optimizer = configure_optimizer(model, **TRAINING)
            # torch AdamW keeps a 4-byte `step` tensor per parameter tensor.
            self.expected = expected_model_states(self.n_params, world_size, 0, n_step_counters=len(trainable))
        else:  # "FSDP <strategy>": apply_fsdp returns the model itself, now an FSDPModule
            strategy = name.split()[1]
            apply_fsdp(model, strategy=strategy)
            self.optimizer = configure_optimizer(model, **TRAINING)  # after sharding: it sees the shards
            self.probe.watch(list(model.parameters()))  # the DTensor shards, also while gathered ones are swapped in
            self.expected = expected_fsdp_model_states(model, world_size, rank, strategy=strategy)

    def train_step(self, rows: torch.Tensor) -> None:
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        # the step leaves what it holds in place: memory() measures it next
        train_step(self.forward, [rows], self.optimizer, grad_norm=False, zero_grad=False)

    def memory(self) -> dict:
        """Bytes of model states this rank holds now (call it right after an optimizer step)."""
        if self.zero is not None:
            return measure_model_states(self.model, None, extra=self.zero.state_tensors())
        return measure_model_states(self.model, self.optimizer)


def sharding_bench(strategies=DATA_PARALLEL_STRATEGIES, preset: str = "small", global_batch: int = 8, seq_len: int = 128,
                   warmup: int = 2, steps: int = 10, seed: int = 0) -> dict:
    """Worker: `warmup` + `steps` rounds, each one step of every strategy on this rank's rows of one global batch.

    Returns {rank, world_size, threads, strategies: {name: {n_params, memory, expected, step_samples,
    peak_params, peak_grads, peak_gathered}}}: memory and expected in bytes for this rank after the last step;
    step_samples the timed steps of the slowest rank (the same list on every rank); peak_* from the last
    warm-up round (see PeakProbe); peak_gathered = Zero3Optimizer.peak_gathered_bytes (ZeRO-3, else None).
    """
    info = get_dist_info()
    unknown = [s for s in strategies if s not in DATA_PARALLEL_STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies must be a non-empty selection of {list(DATA_PARALLEL_STRATEGIES)}, got {list(strategies)}")
    if global_batch % info.world_size:
        raise ValueError(f"global_batch ({global_batch}) must be divisible by world_size ({info.world_size})")
    if warmup < 1 or steps < 1:
        raise ValueError(f"need warmup >= 1 (the probed round) and steps >= 1, got warmup={warmup}, steps={steps}")
    config = GPTConfig.from_preset(preset)
    if not 2 <= seq_len <= config.block_size:
        raise ValueError(f"seq_len must be in [2, {config.block_size}] (block_size of the {preset} preset), "
                         f"got {seq_len}")
    trainees = [Trainee(name, config, seed, info.world_size, info.rank) for name in strategies]
    samples: dict[str, list[float]] = {t.name: [] for t in trainees}
    orders = williams_orders(len(trainees))
    for round_index, batch in enumerate(global_batches(warmup + steps, global_batch, seq_len, seed)):
        rows = local_rows(batch, info.rank, info.world_size)
        # Balanced turns (a Williams design): every strategy runs right after every other equally often.
        order = [trainees[i] for i in orders[round_index % len(orders)]]
        probing = round_index == warmup - 1
        elapsed = []
        for trainee in order:
            if probing:
                trainee.probe.start()
            dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's
            start = time.perf_counter()
            trainee.train_step(rows)
            elapsed.append(time.perf_counter() - start)
            if probing:
                trainee.probe.stop()
        slowest = torch.tensor(elapsed, dtype=torch.float64, device=info.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is done when its slowest rank is done
        if round_index >= warmup:
            for trainee, seconds in zip(order, slowest.tolist()):
                samples[trainee.name].append(seconds)
    results = {}
    for trainee in trainees:  # nothing has touched a strategy's tensors since its last optimizer step
        memory = trainee.memory()
        results[trainee.name] = {
            "n_params": trainee.n_params, "memory": memory, "expected": trainee.expected,
            "step_samples": samples[trainee.name],
            "peak_params": max(trainee.probe.peak["params"], memory["params"]),
            "peak_grads": max(trainee.probe.peak["grads"], memory["grads"]),
            "peak_gathered": getattr(trainee.zero, "peak_gathered_bytes", None)}
    return {"rank": info.rank, "world_size": info.world_size, "threads": torch.get_num_threads(),
            "strategies": results}

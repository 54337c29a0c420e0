"""Rank worker of `make bench`'s parallel section: step time and bytes communicated by data, tensor and pipeline
parallelism, all trained in the same ranks and taking turns step by step.

    from course_lib.runtime.launch import launch
    from course_tools.bench.parallel_workers import parallel_bench
    ranks = launch(parallel_bench, 2, kwargs=dict(preset="tiny", config_overrides={"n_layer": 4}, steps=3),
                   threads_per_rank=1)
    ranks[0]["strategies"]["TP"]["payload_bytes"]   # bytes rank 0 handed to all-reduce, per timed step

    .venv/bin/python scripts/bench.py --only parallel        # the table, at 2 and 4 ranks

Every strategy wraps its own copy of the same model (same seed) with the course's code and trains it with
AdamW on the same global batches:

- DP: torch DDP, each rank a slice of the batch's rows. A communication hook (torch's own allreduce_hook
  behind a counter) counts the gradient bytes of every bucket DDP all-reduces.
- TP: course_lib.tensor_parallel.tp_layers.apply_tensor_parallel over all the ranks, every rank the whole batch; its
  CommStats count the payload of every f / g all-reduce.
- PP 1F1B / PP GPipe: course_lib.pipeline_parallel.stage, one stage per rank, the batch cut into micro-batches;
  PipelineRunner.bytes_sent counts the activations and activation gradients sent, allreduce_tied_grad
  returns the bytes of the tied embedding's gradient that the first and last stage all-reduce.

Each round, every strategy trains one step, in an order that changes every round so that each runs right after
every other equally often (course_lib.observability.timing.williams_orders); all of them see the same stretches
of machine load. A step (zero_grad, forward, backward, gradient communication, optimizer step) is timed from a
barrier to the slowest rank's end.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from course_lib.core.model import GPTConfig
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.data_parallel.torch_ddp import apply_ddp
from course_lib.observability.timing import williams_orders
from course_lib.pipeline_parallel.stage import (
    GPTStage,
    PipelineRunner,
    allreduce_tied_grad,
    broadcast_tied_weight,
    tied_weight_group,
)
from course_lib.runtime.env import get_dist_info
from course_lib.sharding.zero_workers import TRAINING
from course_lib.tensor_parallel.tp_layers import apply_tensor_parallel, check_tensor_parallel_config
from course_lib.parity import global_batches, local_rows, seeded_gpt

PARALLEL_STRATEGIES = ("DP", "TP", "PP 1F1B", "PP GPipe")
PP_SCHEDULES = {"PP 1F1B": "1f1b", "PP GPipe": "gpipe"}


def _optimizer_step(model, optimizer, rows: torch.Tensor) -> torch.Tensor:
    """zero_grad, forward with the loss, backward, optimizer step (core.steps.train_step); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    return torch.tensor(train_step(model, [rows], optimizer, grad_norm=False)["loss"])


class DataParallel:
    """torch DDP over the world; every bucket's gradient bytes counted on their way to all_reduce."""

    def __init__(self, config: GPTConfig, seed: int, rank: int, world_size: int):
        self.model = seeded_gpt(seed, config=config)
        # No buffer sync before each forward: the only buffers are RoPE's constant cos/sin tables, which DDP
        # would otherwise broadcast before every forward: communication that is not gradient synchronisation.
        self.ddp = apply_ddp(self.model)
        self.ddp.register_comm_hook(None, self._counting_allreduce)
        self.optimizer = configure_optimizer(self.model, **TRAINING)
        self.rank, self.world_size = rank, world_size
        self.payload_bytes = self.calls = 0

    def _counting_allreduce(self, process_group, bucket):  # no annotation: DDP checks it against GradBucket
        buffer = bucket.buffer()  # the bucket's gradients, flattened: exactly what all_reduce receives
        self.payload_bytes += buffer.numel() * buffer.element_size()
        self.calls += 1
        return allreduce_hook(process_group, bucket)  # DDP's default: average over the ranks

    def train_step(self, batch: torch.Tensor) -> torch.Tensor:
        self.payload_bytes = self.calls = 0
        return _optimizer_step(self.ddp, self.optimizer, local_rows(batch, self.rank, self.world_size))

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean loss of the whole batch: the ranks' losses are means over equal slices."""
        total = loss.clone()
        dist.all_reduce(total)
        return total.item() / self.world_size


class TensorParallel:
    """course_lib.tensor_parallel.tp_layers over the world: every rank the whole batch and 1/n of every block."""

    def __init__(self, config: GPTConfig, seed: int, rank: int, world_size: int):
        self.model = seeded_gpt(seed, config=config)
        self.stats = apply_tensor_parallel(self.model).tp_stats
        self.optimizer = configure_optimizer(self.model, **TRAINING)

    @property
    def payload_bytes(self) -> int:
        return self.stats.total_bytes

    @property
    def calls(self) -> int:
        return self.stats.total_calls

    def train_step(self, batch: torch.Tensor) -> torch.Tensor:
        self.stats.reset()
        return _optimizer_step(self.model, self.optimizer, batch)

    def global_loss(self, loss: torch.Tensor) -> float:
        return loss.item()  # every rank computed the loss of the whole batch


class PipelineParallel:
    """course_lib.pipeline_parallel.stage: stage = rank; sends and the tied embedding's gradient all-reduce counted."""

    def __init__(self, config: GPTConfig, seed: int, rank: int, world_size: int, schedule: str,
                 micro_batches: int, tied_group):
        self.stage = GPTStage(seeded_gpt(seed, config=config), rank, world_size)
        self.tied_group, self.world_size = tied_group, world_size
        broadcast_tied_weight(self.stage, tied_group)
        self.runner = PipelineRunner(self.stage, schedule, micro_batches)
        self.optimizer = configure_optimizer(self.stage, **TRAINING)
        # One message per action that hands something on: a forward to the next stage, a backward to the previous.
        self.sends = sum(1 for kind, _ in self.runner.actions
                         if (kind == "F" and not self.stage.is_last) or (kind == "B" and not self.stage.is_first))
        self.payload_bytes = self.calls = 0

    def train_step(self, batch: torch.Tensor) -> torch.Tensor | None:
        self.optimizer.zero_grad(set_to_none=True)
        tied = {}
        loss = train_step(self.stage, [batch], self.optimizer, grad_norm=False,
                          forward_backward=lambda micro_batches: self.runner.step(micro_batches[0]),
                          after_backward=lambda: tied.update(bytes=allreduce_tied_grad(self.stage, self.tied_group)))["loss"]
        tied_bytes = tied["bytes"]
        self.payload_bytes = sum(self.runner.bytes_sent.values()) + tied_bytes
        self.calls = self.sends + (tied_bytes > 0)
        return None if loss is None else torch.tensor(loss)

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The last stage's loss, sent to every rank."""
        value = torch.zeros(()) if loss is None else loss.to(torch.float32)
        dist.broadcast(value, src=self.world_size - 1)
        return value.item()


def check_parallel_workload(config: GPTConfig, world_size: int, global_batch: int, seq_len: int,
                            micro_batches: int) -> None:
    """Raise a clear error before any rank starts work the chosen shapes cannot split."""
    if global_batch % world_size:
        raise ValueError(f"global_batch ({global_batch}) must be divisible by the world size ({world_size}): "
                         "data parallelism gives every rank the same number of rows")
    if not isinstance(micro_batches, int) or micro_batches < 1 or global_batch % micro_batches:
        raise ValueError(f"micro_batches ({micro_batches!r}) must be a positive divisor of global_batch "
                         f"({global_batch})")
    if not 2 <= seq_len <= config.block_size:
        raise ValueError(f"seq_len must be in [2, {config.block_size}] (GPTConfig.block_size), got {seq_len}")
    check_tensor_parallel_config(config, world_size)
    if config.n_layer < world_size:
        raise ValueError(f"GPTConfig.n_layer ({config.n_layer}) must be at least the world size ({world_size}): "
                         "every pipeline stage needs a block (override n_layer)")


def parallel_bench(strategies=PARALLEL_STRATEGIES, preset: str = "small", config_overrides: dict | None = None,
                   global_batch: int = 8, seq_len: int = 128, micro_batches: int = 4, warmup: int = 2,
                   steps: int = 10, seed: int = 0) -> dict:
    """Worker: `warmup` + `steps` rounds, each one training step of every strategy on the same global batch.

    Returns {rank, world_size, threads, n_params, strategies: {name: {step_samples, payload_bytes, calls,
    first_loss}}}: step_samples the timed steps of the slowest rank (the same list on every rank);
    payload_bytes and calls what this rank handed to collectives and sends in each timed step; first_loss
    the whole batch's loss at the first step (every strategy starts from the same weights).
    """
    info = get_dist_info()
    unknown = [s for s in strategies if s not in PARALLEL_STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies must be a non-empty selection of {list(PARALLEL_STRATEGIES)}, got {list(strategies)}")
    if warmup < 1 or steps < 1:
        raise ValueError(f"need warmup >= 1 and steps >= 1, got warmup={warmup}, steps={steps}")
    config = GPTConfig.from_preset(preset, **(config_overrides or {}))
    check_parallel_workload(config, info.world_size, global_batch, seq_len, micro_batches)
    tied_group = tied_weight_group(info.world_size)  # every rank creates it, even when no stage uses it
    trainees = {}
    for name in strategies:
        if name == "DP":
            trainees[name] = DataParallel(config, seed, info.rank, info.world_size)
        elif name == "TP":
            trainees[name] = TensorParallel(config, seed, info.rank, info.world_size)
        else:
            trainees[name] = PipelineParallel(config, seed, info.rank, info.world_size, PP_SCHEDULES[name],
                                              micro_batches, tied_group)
    names = list(trainees)
    orders = williams_orders(len(names))
    results = {name: {"step_samples": [], "payload_bytes": [], "calls": [], "first_loss": None} for name in names}
    for round_index, batch in enumerate(global_batches(warmup + steps, global_batch, seq_len, seed)):
        # Balanced turns (a Williams design): every strategy runs right after every other equally often.
        order = [names[i] for i in orders[round_index % len(orders)]]
        elapsed, losses = [], {}
        for name in order:
            dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's
            start = time.perf_counter()
            losses[name] = trainees[name].train_step(batch)
            elapsed.append(time.perf_counter() - start)
        slowest = torch.tensor(elapsed, dtype=torch.float64, device=info.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is done when its slowest rank is done
        if round_index == 0:  # outside the timed steps: the extra collectives cost nothing that is measured
            for name in names:
                results[name]["first_loss"] = trainees[name].global_loss(losses[name])
        if round_index >= warmup:
            for name, seconds in zip(order, slowest.tolist()):
                record = results[name]
                record["step_samples"].append(seconds)
                record["payload_bytes"].append(trainees[name].payload_bytes)
                record["calls"].append(trainees[name].calls)
    dist.barrier()
    return {"rank": info.rank, "world_size": info.world_size, "threads": torch.get_num_threads(),
            "n_params": seeded_gpt(seed, config=config).num_params(), "strategies": results}

"""Logging a training run: gradient norms and throughput for the course's one logger
(course_lib.core.metrics.MetricsLogger: metrics.jsonl, TensorBoard and, with wandb, an offline W&B run), and
reading TensorBoard and W&B files back.

The W&B run is written to out_dir/wandb/offline-run-<time>-<id>/. Nothing leaves the machine: on a cluster node
without internet, log offline and upload later from a login node:

    tensorboard --logdir runs/                      # then open http://localhost:6006
    wandb login                                     # once, on a machine with internet
    wandb sync runs/<run>/wandb/offline-run-*       # uploads the offline runs

    from course_lib.core import MetricsLogger
    from course_lib.observability import log_gradients, log_throughput
    with MetricsLogger("runs/demo", config={"lr": 3e-3}, wandb="auto") as logger:
        logger.log_scalars(step, loss=loss)                              # tag train/loss
        log_gradients(logger, model, step)                               # grad_norm/total, grad_norm/blocks.0, ...
        log_throughput(logger, step, tokens=4096, seconds=0.12)          # throughput/tokens_per_s, ...

    python -m course_lib.observability.experiment_log --out_dir runs/log_demo    # a short run, then what was written

Without wandb installed, wandb="auto" prints one line and logs to TensorBoard and metrics.jsonl only;
wandb=True raises an ImportError that says what to install. In a job of many ranks, log from rank 0 only.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time
from pathlib import Path

import torch

from course_lib.core.data import RandomBatches, synthetic_tokens
from course_lib.core.metrics import MetricsLogger
from course_lib.core.steps import train_step
from course_lib.parity import seeded_gpt

_WANDB_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version: the start of a .wandb file
_RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type (full / first / middle / last)
_BLOCK = 32 * 1024


def wandb_available() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def gradient_norms(model: torch.nn.Module, depth: int | None = 2) -> dict[str, float]:
    """L2 norm of the gradients, in total and per group of parameters, after backward (before clipping).

    depth=2 groups by the first two parts of the module path ("blocks.0", "tok_emb", "norm_f");
    depth=None gives one norm per parameter tensor. A group's norm is sqrt(sum of its squared norms),
    so the groups' norms combine into the total the same way clip_grad_norm_ measures it.
    """
    squares: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        parts = name.split(".")
        group = name if depth is None else ".".join(parts[:-1][:depth] or parts)
        squares[group] = squares.get(group, 0.0) + param.grad.detach().float().pow(2).sum().item()
    if not squares:
        raise ValueError("no parameter has a gradient: call gradient_norms after loss.backward()")
    norms = {group: math.sqrt(s) for group, s in squares.items()}
    return {"total": math.sqrt(sum(squares.values())), **norms}


def log_gradients(logger: MetricsLogger, model: torch.nn.Module, step: int, depth: int | None = 2) -> dict:
    """Log gradient_norms(model, depth) under grad_norm/...; call after backward, before the gradients are cleared."""
    norms = gradient_norms(model, depth)
    logger.log_scalars(step, kind="grad_norm", **norms)
    return norms


def log_throughput(logger: MetricsLogger, step: int, *, tokens: int, seconds: float,
                   flops_per_token: int | None = None) -> dict:
    """tokens/s of a step (and model GFLOP/s when flops_per_token is given) under throughput/..."""
    values = {"tokens_per_s": tokens / seconds, "step_time_s": seconds}
    if flops_per_token is not None:
        values["gflops"] = flops_per_token * tokens / seconds / 1e9
    logger.log_scalars(step, kind="throughput", **values)
    return values


def read_tensorboard_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the TensorBoard event files of tb_dir."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    tb_dir = Path(tb_dir)
    if not any(tb_dir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event file in {tb_dir}")
    accumulator = EventAccumulator(str(tb_dir), size_guidance={SCALARS: 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _wandb_records(path: Path):
    """The protobuf payloads of a .wandb file (a LevelDB-style log of 32 KiB blocks)."""
    data = path.read_bytes()
    if len(data) < _WANDB_HEADER.size:  # just created, header not written yet
        return
    ident, magic, _ = _WANDB_HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = _WANDB_HEADER.size, b""
    while pos + _RECORD_HEADER.size <= len(data):
        if _BLOCK - pos % _BLOCK < _RECORD_HEADER.size:  # too little room left in the block: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        pos += _RECORD_HEADER.size
        if pos + length > len(data):  # a record still being written
            return
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            yield pending
            pending = b""


def read_wandb_history(run_dir, wait_s: float = 30.0) -> list[dict]:
    """The rows logged to an offline W&B run (run_dir: out_dir/wandb/offline-run-...), read from its .wandb file.

    W&B writes the file from a separate process, which may finish a moment after run.finish() returns:
    wait up to wait_s seconds for the run's closing "exit" record (a crashed run never gets one; then
    the rows written so far are returned).
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + wait_s
    while True:
        files = sorted(Path(run_dir).glob("run-*.wandb"))
        records = []
        for payload in _wandb_records(files[0]) if files else ():
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
        finished = any(r.WhichOneof("record_type") == "exit" for r in records)
        if finished or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}")
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default="runs/log_demo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--wandb", default="auto", choices=["auto", "on", "off"])
    args = parser.parse_args(argv)
    model = seeded_gpt(0, "tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = RandomBatches(synthetic_tokens(50_000), 8, 64)
    use_wandb = {"auto": "auto", "on": True, "off": False}[args.wandb]
    with MetricsLogger(args.out_dir, config={"lr": 3e-3, "preset": "tiny"}, wandb=use_wandb) as logger:
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            idx = next(batches)
            stats = train_step(model, [idx], optimizer, after_backward=lambda: log_gradients(logger, model, step),
                               grad_norm=False)
            logger.log_scalars(step, loss=stats["loss"])
            log_throughput(logger, step, tokens=idx.numel(), seconds=time.perf_counter() - start)
        wandb_dir = logger.wandb_dir
    scalars = read_tensorboard_scalars(Path(args.out_dir) / "tb")
    print(f"TensorBoard: {len(scalars)} tags in {Path(args.out_dir) / 'tb'}, e.g. train/loss {scalars['train/loss'][-1]}")
    if wandb_dir is not None:
        rows = read_wandb_history(wandb_dir)
        print(f"W&B offline run: {wandb_dir} ({len(rows)} rows); upload with `wandb sync {wandb_dir}`")


if __name__ == "__main__":
    main()

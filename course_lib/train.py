"""Single-process training of the course GPT: the loop every later strategy (DDP, FSDP, ...) builds on.

AdamW with decay / no-decay groups, linear warmup + cosine decay, gradient accumulation, gradient
clipping, autocast (see course_lib.core.device), held-out evaluation, atomic checkpoints every N steps, exact
resume, per-step metrics (loss, lr, grad norm, tokens/s) to out_dir/metrics.jsonl and TensorBoard.

    python -m course_lib.train --model_size tiny --max_steps 200 --batch_size 16 --lr 3e-3 --device auto \\
        --out_dir runs/tiny
    python -m course_lib.train --out_dir runs/tiny --max_steps 400 --resume     # continue from runs/tiny/latest.pt
    python -m course_lib.train --config_path config/config.json --precision bf16 --threads 2
    python -m course_lib.train --help                                           # every TrainConfig field

Data parallel (torch DDP) or fully sharded (FSDP2, see course_lib.sharding.fsdp): one process, or N ranks under
torchrun:

    python -m course_lib.train --strategy ddp --model_size small --max_steps 50
    torchrun --nproc_per_node=2 -m course_lib.train --strategy ddp --model_size small --max_steps 50
    torchrun --nproc_per_node=2 -m course_lib.train --strategy fsdp --model_size medium --max_steps 50

Each rank takes its own rows of one global batch (batch_size rows per rank, batch_size * world_size in all),
so N ranks take the same steps as one process with batch_size * N; rank 0 writes metrics and checkpoints,
every rank logs to <log_dir>/rank_<r>/train.log. FSDP checkpoints are gathered into the same single file.

Resuming restores model, optimizer, scheduler, GradScaler, every RNG and the data position, so the
continued run's losses equal an uninterrupted run's bit for bit (same device, threads and torch version).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from course_lib.checkpoint.atomic import (
    move_earlier_run,
    load_checkpoint,
    remove_partial_files,
    resolve_resume,
    save_training_checkpoint,
)
from course_lib.checkpoint.fsdp import load_full_checkpoint, save_full_checkpoint
from course_lib.core.config import add_dataclass_arguments, load_model_config
from course_lib.core.data import RandomBatches, load_tokens, synthetic_tokens
from course_lib.core.device import DEVICE_CHOICES, PRECISION_CHOICES, autocast_dtype, needs_grad_scaler, select_device
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPT, PRESETS, GPTConfig
from course_lib.core.optim import configure_optimizer, make_scheduler
from course_lib.core.steps import evaluate, train_step
from course_lib.runtime.env import cleanup, init_distributed, setup_rank_logging
from course_lib.data_parallel.torch_ddp import apply_ddp
from course_lib.sharding import fsdp
from course_lib.sharding.fsdp import apply_fsdp, mixed_precision_policy, precision_of

DATASETS = ("corpus", "synthetic")


@dataclass(frozen=True)
class Strategy:
    """How `train` runs under one --strategy: what it applies to the model, and who saves, loads and evaluates."""

    distributed: bool
    """Starts a process group: torchrun's ranks, or one rank without torchrun."""
    apply: Callable
    """(model, cfg, autocast dtype) -> (the module to train through, the autocast dtype still to use)."""
    save: Callable = save_training_checkpoint
    load: Callable = load_checkpoint
    every_rank_saves: bool = False
    """Every rank takes part in saving (FSDP sends its shards to the one file rank 0 writes); else rank 0 alone."""
    split_evaluation: bool = True
    """Each rank evaluates its share of the validation batches; False: all ranks every batch together (an FSDP
    forward all-gathers the weights, so every rank must run it)."""


def _apply_fsdp(model, cfg, amp_dtype):
    """FSDP2 with the policy of the precision the run asked for; it casts for compute, so no autocast on top."""
    return apply_fsdp(model, strategy=cfg.sharding, mp_policy=mixed_precision_policy(precision_of(amp_dtype))), None


STRATEGIES = {
    "single": Strategy(distributed=False, apply=lambda model, cfg, amp_dtype: (model, amp_dtype)),
    # DDP broadcasts rank 0's weights and all-reduces gradients in backward; `model` stays the plain module.
    "ddp": Strategy(distributed=True, apply=lambda model, cfg, amp_dtype: (apply_ddp(model), amp_dtype)),
    "fsdp": Strategy(distributed=True, apply=_apply_fsdp, save=save_full_checkpoint, load=load_full_checkpoint,
                     every_rank_saves=True, split_evaluation=False),
}
SYNTHETIC_NUM_TOKENS = 200_000  # dataset="synthetic": this many "motifs" tokens, the last 10% held out


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a training run needs. Each field is a --flag of `python -m course_lib.train`."""

    model_size: str = "tiny"
    """Model preset from course_lib.core.model.PRESETS (tiny, small, medium, gpt2-small); unused with config_path."""
    config_path: str | None = None
    """JSON model config (e.g. config/config.json) to use instead of model_size."""
    block_size: int | None = None
    """Sequence length of a training sample; overrides the model's block_size. None keeps the model's."""
    max_steps: int = 200
    """Optimizer steps of the whole run; the LR schedule ends here."""
    stop_at_step: int | None = None
    """End this invocation after this step (checkpointing there) although the schedule runs to max_steps."""
    batch_size: int = 16
    """Sequences per micro-batch (one forward/backward)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: tokens per step = batch_size * grad_accum_steps * block_size."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; None means lr / 10."""
    warmup_steps: int | None = None
    """Steps of linear warmup from lr / warmup_steps up to lr; None means max_steps // 10."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (>= 2-D parameters); norms and biases get none."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    eval_interval: int = 50
    """Evaluate on the validation split every this many steps (and at the last step); 0: only at the end."""
    eval_batches: int = 20
    """Validation batches per evaluation (the same batches every time)."""
    ckpt_interval: int = 100
    """Checkpoint every this many steps (and at the last step); 0: only at the end."""
    keep_last: int | None = None
    """Keep only this many ckpt_step*.pt files (latest.pt always stays); None keeps all."""
    out_dir: str = "runs/tiny"
    """Directory for checkpoints, metrics.jsonl and TensorBoard events (tb/)."""
    resume: bool | str = False
    """True: continue from out_dir/latest.pt; a path: from that file; 'auto': resume if a checkpoint exists.
    False: start fresh; an earlier run's checkpoints and metrics in out_dir move to out_dir/earlier_runs/<time>/."""
    seed: int = 0
    """Seed of model init, dropout and the order of training batches."""
    device: str = "auto"
    """auto (cuda > mps > cpu), cuda, cuda:N, mps or cpu."""
    precision: str = "auto"
    """auto, fp32, bf16 or fp16 (fp16 on CUDA only, with a GradScaler); see course_lib.core.device."""
    log_interval: int = 0
    """Print a line of loss / lr / tokens per second every this many steps; 0 prints none (the bar shows them)."""
    tensorboard: bool = True
    """Also write metrics as TensorBoard scalars to out_dir/tb."""
    progress: bool = True
    """Show a tqdm progress bar."""
    data_dir: str = "data"
    """Where the tokenized corpus lives (data/train.bin, data/val.bin; created on first use)."""
    dataset: str = "corpus"
    """corpus (the shipped text) or synthetic (a learnable token stream, for quick tests)."""
    threads: int | None = None
    """torch.set_num_threads for this process; None leaves torch's default."""
    strategy: str = "single"
    """single (one process), ddp (torch DistributedDataParallel) or fsdp (FSDP2); one rank per process."""
    sharding: str = "FULL_SHARD"
    """strategy fsdp: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD (course_lib.sharding.fsdp.SHARDING_STRATEGIES)."""
    log_dir: str = "logs"
    """strategy ddp / fsdp: every rank writes its log lines to <log_dir>/rank_<r>/train.log."""

    def __post_init__(self):
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        if self.warmup_steps is None and isinstance(self.max_steps, int):
            self.warmup_steps = self.max_steps // 10
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        rules = [  # (fields, what they must be, test)
            (("max_steps", "batch_size", "grad_accum_steps", "eval_batches"), "a positive integer",
             lambda v: is_int(v) and v > 0),
            (("warmup_steps", "eval_interval", "ckpt_interval", "log_interval", "seed"), "an integer >= 0",
             lambda v: is_int(v) and v >= 0),
            (("block_size", "stop_at_step", "keep_last", "threads"), "None or a positive integer",
             lambda v: v is None or (is_int(v) and v > 0)),
            (("warmup_steps", "stop_at_step"), f"<= max_steps ({self.max_steps})",
             lambda v: v is None or v <= self.max_steps),
            (("lr",), "positive", lambda v: v > 0),
            (("min_lr",), f"between 0 and lr ({self.lr})", lambda v: 0 <= v <= self.lr),
            (("weight_decay", "grad_clip"), ">= 0", lambda v: v >= 0),
            (("model_size",), f"one of {sorted(PRESETS)} (or set config_path)",
             lambda v: self.config_path is not None or v in PRESETS),
            (("dataset",), f"one of {DATASETS}", lambda v: v in DATASETS),
            (("strategy",), f"one of {list(STRATEGIES)}", lambda v: v in STRATEGIES),
            (("sharding",), f"one of {list(fsdp.SHARDING_STRATEGIES)}", lambda v: v in fsdp.SHARDING_STRATEGIES),
            (("precision",), f"one of {PRECISION_CHOICES}", lambda v: v in PRECISION_CHOICES),
            (("device",), f"one of {DEVICE_CHOICES} or cuda:N", lambda v: str(v).split(":")[0] in DEVICE_CHOICES),
            (("resume",), "True, False, 'auto' or a checkpoint path", lambda v: isinstance(v, (bool, str, Path))),
        ]
        for names, rule, ok in rules:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"TrainConfig.{name} must be {rule}, got {getattr(self, name)!r}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_model_config(cfg: TrainConfig) -> GPTConfig:
    overrides = {} if cfg.block_size is None else {"block_size": cfg.block_size}
    if cfg.config_path is not None:
        return load_model_config(cfg.config_path, **overrides)
    return GPTConfig.from_preset(cfg.model_size, **overrides)


def load_splits(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens) as 1-D tensors."""
    if cfg.dataset == "synthetic":
        tokens = synthetic_tokens(SYNTHETIC_NUM_TOKENS, seed=0)  # fixed data; cfg.seed varies init and order
        split = int(0.9 * len(tokens))
        return tokens[:split], tokens[split:]
    return load_tokens("train", cfg.data_dir), load_tokens("val", cfg.data_dir)


SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "max_steps")


def continue_schedule(cfg: TrainConfig, optimizer, scheduler, saved: dict) -> list[str]:
    """After loading a checkpoint: the schedule goes on with this run's lr, min_lr, warmup_steps and max_steps.

    The checkpoint's LambdaLR state carries the saved run's lr as its base, which would silently override a new
    --lr; the new settings are applied instead. Returns what changed ("lr 0.003 -> 1e-05"), for the log.
    """
    changes = [f"{name} {saved[name]} -> {getattr(cfg, name)}" for name in SCHEDULE_FIELDS
               if name in saved and saved[name] != getattr(cfg, name)]
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor(scheduler.last_epoch)
    return changes


def check_splits(cfg: TrainConfig, config: GPTConfig, splits: dict[str, torch.Tensor]) -> None:
    """Every split holds at least one window of block_size tokens, and no token id beyond the vocabulary."""
    for split, tokens in splits.items():
        where = "the synthetic dataset" if cfg.dataset == "synthetic" else str(Path(cfg.data_dir) / f"{split}.bin")
        if len(tokens) < config.block_size:
            raise ValueError(f"block_size={config.block_size} does not fit the {split} split: {where} holds "
                             f"{len(tokens):,} tokens; use a smaller --block_size or more data")
        top = int(tokens.max())
        if top >= config.vocab_size:
            raise ValueError(f"vocab_size={config.vocab_size} is too small for {where}: it holds token id {top} "
                             f"(the byte tokenizer has 256 ids); set vocab_size to at least {top + 1}")


def train(cfg: TrainConfig) -> dict:
    """Run (or continue) training; returns history, evals, model and paths (see the end of the function)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    strategy = STRATEGIES[cfg.strategy]
    rank, world_size, rank_log = 0, 1, None
    if strategy.distributed:
        info = init_distributed(device="auto" if cfg.device in ("auto", "mps") else cfg.device.split(":")[0])
        rank, world_size, device = info.rank, info.world_size, info.device
        rank_log = setup_rank_logging(cfg.log_dir, console=False)  # the console has rank 0's bar
    else:
        device = select_device(cfg.device)
    is_main = rank == 0
    amp_dtype = autocast_dtype(device, cfg.precision)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        remove_partial_files(out_dir)
    seed_everything(cfg.seed)
    config = build_model_config(cfg)
    model = GPT(config).to(device)
    scaler = torch.amp.GradScaler(device.type) if needs_grad_scaler(device, amp_dtype) else None
    train_model, amp_dtype = strategy.apply(model, cfg, amp_dtype)
    no_sync = getattr(train_model, "no_sync", None)  # a wrapper that can skip the sync of accumulating steps
    optimizer = configure_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                               max_steps=cfg.max_steps)
    train_tokens, val_tokens = load_splits(cfg)
    check_splits(cfg, config, {"train": train_tokens, "val": val_tokens})  # before step 1, not at the first eval
    # Every rank draws the same global batch and keeps its own rows: disjoint data, one process's order.
    batches = RandomBatches(train_tokens, cfg.batch_size * world_size, config.block_size, seed=cfg.seed)
    my_rows = slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
    start_step, resume_from = 0, resolve_resume(cfg.resume, out_dir)
    if resume_from is not None:
        ckpt = strategy.load(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        saved_rows = (ckpt["data_state"] or {}).get("batch_size")
        if saved_rows is not None and saved_rows != batches.batch_size:
            raise ValueError(f"{resume_from} was written by a run with a global batch of {saved_rows} rows (--batch_size "
                             f"per rank x ranks); this run has --batch_size {cfg.batch_size} x {world_size} rank(s) = "
                             f"{batches.batch_size}: resume with the same global batch")
        batches.load_state_dict(ckpt["data_state"])
        start_step = ckpt["step"]
        changes = continue_schedule(cfg, optimizer, scheduler, (ckpt.get("extra") or {}).get("train_config") or {})
        if changes and is_main:
            tqdm.write(f"note: resuming {resume_from} at step {start_step} with {', '.join(changes)}: applied from "
                       f"step {start_step + 1} on (lr now {optimizer.param_groups[0]['lr']:.3g})")
    elif is_main and (moved := move_earlier_run(out_dir)):  # else --resume would later pick up the old run's latest.pt
        tqdm.write(f"note: fresh run in {out_dir}: the earlier run's checkpoints and metrics were moved to {moved} "
                   "(use --resume to continue a run instead)")
    last_step = cfg.stop_at_step or cfg.max_steps
    if world_size > 1:
        dist.barrier()  # rank 0 has cleared or checked out_dir before anyone writes
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * config.block_size * world_size
    train_config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    history, evals, ckpt_path = [], [], None
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard,
                           resume_step=start_step if resume_from else None) if is_main else None
    bar = tqdm(total=last_step, initial=start_step, desc="train", unit="step", disable=not cfg.progress or not is_main,
               dynamic_ncols=True)
    try:
        for step in range(start_step + 1, last_step + 1):  # `step` = optimizer steps done after this iteration
            start = time.perf_counter()
            micro_batches = [next(batches)[my_rows].to(device) for _ in range(cfg.grad_accum_steps)]
            stats = train_step(train_model, micro_batches, optimizer, scheduler, scaler=scaler,
                               grad_clip=cfg.grad_clip, amp_dtype=amp_dtype, no_sync=no_sync)
            if world_size > 1:  # each rank saw different rows: report the mean loss of the global batch
                stats["local_loss"] = stats["loss"]
                loss = torch.tensor([stats["loss"]], dtype=torch.float64, device=device)
                dist.all_reduce(loss)
                stats["loss"] = loss.item() / world_size
            elapsed = time.perf_counter() - start  # .item() in train_step waited for the device
            if not math.isfinite(stats["loss"]) and scaler is None:
                raise FloatingPointError(f"loss is {stats['loss']} at step {step}: training diverged; lower lr "
                                         f"(now {stats['lr']:.3g}) or set grad_clip")
            record = {"kind": "train", "step": step, **stats, "tokens_per_s": tokens_per_step / elapsed,
                      "step_time_s": elapsed}
            if logger:
                logger.log(record)
            if rank_log and (step % max(cfg.log_interval, 1) == 0 or step == last_step):
                rank_log.info(f"step {step} | loss {stats['loss']:.4f} | local loss {stats.get('local_loss', stats['loss']):.4f}"
                              f" | lr {stats['lr']:.2e} | grad norm {stats['grad_norm']:.3f} | "
                              f"{record['tokens_per_s']:,.0f} tok/s (all ranks)")
            history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            if cfg.log_interval and step % cfg.log_interval == 0 and is_main:
                bar.write(f"step {step:6d} | loss {stats['loss']:.4f} | lr {stats['lr']:.2e} | "
                          f"grad norm {stats['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s")
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == last_step:
                split = (rank, world_size) if strategy.split_evaluation else (0, 1)
                try:
                    val_loss = evaluate(model, val_tokens, batch_size=cfg.batch_size * world_size,
                                        block_size=config.block_size, max_batches=cfg.eval_batches,
                                        amp_dtype=amp_dtype, rank=split[0], world_size=split[1])
                except Exception:
                    if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == last_step:
                        # The steps are done and paid for: keep them before the error ends the run.
                        if strategy.every_rank_saves or is_main:
                            strategy.save(out_dir, step=step, keep_last=cfg.keep_last, model=model,
                                          optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                          data_state=batches.state_dict(),
                                          extra={"train_config": train_config, "val_loss": None})
                    raise
                evals.append({"kind": "eval", "step": step, "val_loss": val_loss})
                if logger:
                    logger.log(evals[-1])
                if rank_log:
                    rank_log.info(f"step {step} | val loss {val_loss:.4f}")
                if cfg.log_interval and is_main:
                    bar.write(f"step {step:6d} | val loss {val_loss:.4f}")
            if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == last_step:
                extra = {"train_config": train_config, "val_loss": evals[-1]["val_loss"] if evals else None}
                if strategy.every_rank_saves or is_main:
                    ckpt_path = strategy.save(out_dir, step=step, keep_last=cfg.keep_last, model=model,
                                              optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                              data_state=batches.state_dict(), extra=extra)
                if world_size > 1:
                    dist.barrier()  # nobody reads latest.pt before rank 0 has finished writing it
    finally:
        bar.close()
        if logger:
            logger.close()
    step_times = [r["step_time_s"] for r in history[3:] or history]  # the first steps warm up allocators
    return {
        "history": history, "evals": evals, "model": model, "model_config": config, "config": cfg,
        "start_step": start_step, "final_step": history[-1]["step"] if history else start_step,
        "final_val_loss": evals[-1]["val_loss"] if evals else None, "device": str(device),
        "median_tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
        "out_dir": out_dir, "checkpoint": ckpt_path, "metrics_path": logger.path if logger else None,
        "rank": rank, "world_size": world_size,
    }


def build_parser() -> argparse.ArgumentParser:
    """One --flag per TrainConfig field; add arguments to the returned parser to extend the CLI."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.train", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_arguments(parser, TrainConfig, special={"resume": dict(
        nargs="?", const=True, type=lambda text: {"true": True, "false": False}.get(text.lower(), text))})
    # The DeepSpeed launcher (and old torch.distributed.launch) pass the local rank in argv, not the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by `deepspeed` / torch.distributed.launch; copied to $LOCAL_RANK")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    if getattr(args, "local_rank", None) is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
"""What bad input raises (a config field, a data file, a checkpoint that does not fit): one clear line on the CLI."""


def main(argv=None) -> dict:
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an input error")
    args = parser.parse_args(argv)
    debug = args.__dict__.pop("debug")
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        result = train(cfg)
    except INPUT_ERRORS as err:
        if debug:
            raise
        parser.exit(2, f"{parser.prog}: error: {err}\n(--debug shows where it was raised)\n")
    finally:
        if STRATEGIES[cfg.strategy].distributed:
            cleanup()
    if result["rank"] != 0:
        return result
    val = result["final_val_loss"]
    ranks = f" x {result['world_size']} ranks" if result["world_size"] > 1 else ""
    print(f"{result['model'].num_params():,}-parameter model on {result['device']}{ranks}: steps {result['start_step']} -> "
          f"{result['final_step']}" + (f", final val loss {val:.4f}" if val is not None else ""))
    if result["median_tokens_per_s"]:
        print(f"median {result['median_tokens_per_s']:,.0f} tokens/s ({torch.get_num_threads()} threads)")
    print(f"checkpoint: {result['checkpoint']}; metrics: {result['metrics_path']}")
    return result


if __name__ == "__main__":
    main()

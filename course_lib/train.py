"""Single-process training of the course GPT: the loop every later strategy (DDP, FSDP, ...) builds on.

AdamW with decay / no-decay groups, linear warmup + cosine decay, gradient accumulation, gradient
clipping, autocast (see course_lib.device), held-out evaluation, atomic checkpoints every N steps, exact
resume, per-step metrics (loss, lr, grad norm, tokens/s) to out_dir/metrics.jsonl and TensorBoard.

    python -m course_lib.train --model_size tiny --max_steps 200 --batch_size 16 --lr 3e-3 --device auto \\
        --out_dir runs/tiny
    python -m course_lib.train --out_dir runs/tiny --max_steps 400 --resume     # continue from runs/tiny/latest.pt
    python -m course_lib.train --config_path config/config.json --precision bf16 --threads 2
    python -m course_lib.train --help                                           # every TrainConfig field

Resuming restores model, optimizer, scheduler, GradScaler, every RNG and the data position, so the
continued run's losses equal an uninterrupted run's bit for bit (same device, threads and torch version).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from course_lib.checkpoint import (clear_checkpoints, load_checkpoint, remove_partial_files, resolve_resume,
                                   save_training_checkpoint)
from course_lib.config import add_dataclass_arguments, load_model_config
from course_lib.data import RandomBatches, eval_batches, load_tokens, synthetic_tokens
from course_lib.device import (DEVICE_CHOICES, PRECISIONS, autocast_context, autocast_dtype, needs_grad_scaler,
                               select_device)
from course_lib.metrics import MetricsLogger
from course_lib.model import GPT, PRESETS, GPTConfig
from course_lib.optim import configure_optimizer, make_scheduler

DATASETS = ("corpus", "synthetic")
SYNTHETIC_NUM_TOKENS = 200_000  # dataset="synthetic": this many "motifs" tokens, the last 10% held out


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a training run needs. Each field is a --flag of `python -m course_lib.train`."""

    model_size: str = "tiny"
    """Model preset from course_lib.model.PRESETS (tiny, small, medium, gpt2-small); unused with config_path."""
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
    False: start fresh, replacing an earlier run's checkpoints and metrics in out_dir."""
    seed: int = 0
    """Seed of model init, dropout and the order of training batches."""
    device: str = "auto"
    """auto (cuda > mps > cpu), cuda, cuda:N, mps or cpu."""
    precision: str = "auto"
    """auto, fp32, bf16 or fp16 (fp16 on CUDA only, with a GradScaler); see course_lib.device."""
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
            (("precision",), f"one of {PRECISIONS}", lambda v: v in PRECISIONS),
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


def accumulate_gradients(model, micro_batches, *, amp_dtype=None, scaler=None, no_sync=None) -> torch.Tensor:
    """Forward + backward over the micro-batches, adding up .grad; returns the mean loss (detached).

    Each loss is divided by the number of micro-batches, so the summed gradient equals the gradient of
    the mean loss over the whole batch. `no_sync` (e.g. DDP's model.no_sync) wraps all but the last
    backward, so a data-parallel wrapper communicates once per step.
    """
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0].device)
    for i, idx in enumerate(micro_batches):
        with no_sync() if no_sync is not None and i < n - 1 else nullcontext():
            with autocast_context(idx.device, amp_dtype):
                _, loss = model(idx, targets=idx)
            scaled = loss / n
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach().float()
    return loss_sum / n


def clip_gradients(parameters, max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (None/0: no clipping); returns the norm before."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm else float("inf"))


def train_step(model, micro_batches, optimizer, scheduler=None, *, scaler=None, grad_clip=None, amp_dtype=None,
               no_sync=None) -> dict:
    """One optimizer step: accumulate, (unscale,) clip, step, advance the schedule, zero the grads.

    Returns {"loss": mean micro-batch loss, "grad_norm": norm before clipping, "lr": lr used}.
    """
    lr = optimizer.param_groups[0]["lr"]
    loss = accumulate_gradients(model, micro_batches, amp_dtype=amp_dtype, scaler=scaler, no_sync=no_sync)
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip true gradients, not scaled ones
    grad_norm = clip_gradients(model.parameters(), grad_clip)
    if scaler is not None:
        scaler.step(optimizer)  # skips the step if the unscaled gradients hold inf/NaN
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr}


@torch.no_grad()
def evaluate(model, tokens, *, batch_size: int, block_size: int, max_batches: int | None, amp_dtype=None) -> float:
    """Mean loss over the first max_batches deterministic validation batches (eval mode, no grad)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, rows = 0.0, 0
    for idx in eval_batches(tokens, batch_size, block_size, max_batches):
        idx = idx.to(device)
        with autocast_context(device, amp_dtype):
            _, loss = model(idx, targets=idx)
        total += loss.item() * idx.size(0)  # the last batch may be short: weight by rows
        rows += idx.size(0)
    model.train(was_training)
    return total / rows


def train(cfg: TrainConfig) -> dict:
    """Run (or continue) training; returns history, evals, model and paths (see the end of the function)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = select_device(cfg.device)
    amp_dtype = autocast_dtype(device, cfg.precision)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_partial_files(out_dir)
    seed_everything(cfg.seed)
    config = build_model_config(cfg)
    model = GPT(config).to(device)
    optimizer = configure_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                               max_steps=cfg.max_steps)
    scaler = torch.amp.GradScaler(device.type) if needs_grad_scaler(device, amp_dtype) else None
    train_tokens, val_tokens = load_splits(cfg)
    batches = RandomBatches(train_tokens, cfg.batch_size, config.block_size, seed=cfg.seed)
    start_step, resume_from = 0, resolve_resume(cfg.resume, out_dir)
    if resume_from is not None:
        ckpt = load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        batches.load_state_dict(ckpt["data_state"])
        start_step = ckpt["step"]
    elif removed := clear_checkpoints(out_dir):  # else --resume would later pick up the old run's latest.pt
        tqdm.write(f"note: fresh run in {out_dir}: removed {len(removed)} checkpoint files of an earlier run "
                   "(use --resume to continue a run instead)")
    last_step = cfg.stop_at_step or cfg.max_steps
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * config.block_size
    train_config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    history, evals, ckpt_path = [], [], None
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard, resume_step=start_step if resume_from else None)
    bar = tqdm(total=last_step, initial=start_step, desc="train", unit="step", disable=not cfg.progress,
               dynamic_ncols=True)
    try:
        for step in range(start_step + 1, last_step + 1):  # `step` = optimizer steps done after this iteration
            start = time.perf_counter()
            micro_batches = [next(batches).to(device) for _ in range(cfg.grad_accum_steps)]
            stats = train_step(model, micro_batches, optimizer, scheduler, scaler=scaler, grad_clip=cfg.grad_clip,
                               amp_dtype=amp_dtype)
            elapsed = time.perf_counter() - start  # .item() in train_step waited for the device
            if not math.isfinite(stats["loss"]) and scaler is None:
                raise FloatingPointError(f"loss is {stats['loss']} at step {step}: training diverged; lower lr "
                                         f"(now {stats['lr']:.3g}) or set grad_clip")
            record = {"kind": "train", "step": step, **stats, "tokens_per_s": tokens_per_step / elapsed,
                      "step_time_s": elapsed}
            logger.log(record)
            history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            if cfg.log_interval and step % cfg.log_interval == 0:
                bar.write(f"step {step:6d} | loss {stats['loss']:.4f} | lr {stats['lr']:.2e} | "
                          f"grad norm {stats['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s")
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == last_step:
                val_loss = evaluate(model, val_tokens, batch_size=cfg.batch_size, block_size=config.block_size,
                                    max_batches=cfg.eval_batches, amp_dtype=amp_dtype)
                evals.append({"kind": "eval", "step": step, "val_loss": val_loss})
                logger.log(evals[-1])
                if cfg.log_interval:
                    bar.write(f"step {step:6d} | val loss {val_loss:.4f}")
            if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == last_step:
                ckpt_path = save_training_checkpoint(
                    out_dir, step=step, keep_last=cfg.keep_last, model=model, optimizer=optimizer,
                    scheduler=scheduler, scaler=scaler, data_state=batches.state_dict(),
                    extra={"train_config": train_config, "val_loss": evals[-1]["val_loss"] if evals else None})
    finally:
        bar.close()
        logger.close()
    step_times = [r["step_time_s"] for r in history[3:] or history]  # the first steps warm up allocators
    return {
        "history": history, "evals": evals, "model": model, "model_config": config, "config": cfg,
        "start_step": start_step, "final_step": history[-1]["step"] if history else start_step,
        "final_val_loss": evals[-1]["val_loss"] if evals else None, "device": str(device),
        "median_tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
        "out_dir": out_dir, "checkpoint": ckpt_path, "metrics_path": logger.path,
    }


def build_parser() -> argparse.ArgumentParser:
    """One --flag per TrainConfig field; add arguments to the returned parser to extend the CLI."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.train", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_arguments(parser, TrainConfig, special={"resume": dict(
        nargs="?", const=True, type=lambda text: {"true": True, "false": False}.get(text.lower(), text))})
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    result = train(cfg)
    val = result["final_val_loss"]
    print(f"{result['model'].num_params():,}-parameter model on {result['device']}: steps {result['start_step']} -> "
          f"{result['final_step']}" + (f", final val loss {val:.4f}" if val is not None else ""))
    if result["median_tokens_per_s"]:
        print(f"median {result['median_tokens_per_s']:,.0f} tokens/s ({torch.get_num_threads()} threads)")
    print(f"checkpoint: {result['checkpoint']}; metrics: {result['metrics_path']}")
    return result


if __name__ == "__main__":
    main()

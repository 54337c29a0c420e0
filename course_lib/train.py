"""Training the course GPT, one process or any parallel layout on many ranks: the one training loop of the course.

AdamW with decay / no-decay groups, linear warmup + cosine decay, gradient accumulation, gradient
clipping, autocast (see course_lib.core.device), held-out evaluation, atomic checkpoints every N steps, exact
resume, per-step metrics (loss, lr, grad norm, tokens/s) to out_dir/metrics.jsonl and TensorBoard.

    python -m course_lib.train --model_size tiny --max_steps 200 --batch_size 16 --lr 3e-3 --device auto \\
        --out_dir runs/tiny
    python -m course_lib.train --out_dir runs/tiny --max_steps 400 --resume     # continue from runs/tiny/latest.pt
    python -m course_lib.train --config_path config/config.json --precision bf16 --threads 2
    python -m course_lib.train --help                                           # every TrainConfig field

Every parallel layout the course teaches, from one process to dp x tp x pp ranks under torchrun; the model and
the loop stay the same, only the wrapping changes (course_lib.parallel: Layout -> parallelize -> train_step):

    torchrun --nproc_per_node=2 -m course_lib.train --model_size small --max_steps 50            # DDP over 2 ranks
    torchrun --nproc_per_node=4 -m course_lib.train --zero 2                                      # ZeRO-2 from scratch
    torchrun --nproc_per_node=2 -m course_lib.train --fsdp                                        # FSDP2
    torchrun --nproc_per_node=2 -m course_lib.train --tp 2 --sp                                   # tensor + sequence
    torchrun --nproc_per_node=2 -m course_lib.train --pp 2 --schedule 1f1b --micro_batches 4      # pipeline
    torchrun --nproc_per_node=8 -m course_lib.train --dp 2 --tp 2 --pp 2                          # 3D

--dp defaults to the ranks left over by tp * pp. Each data-parallel replica takes its own rows of one global batch
(batch_size rows per replica, batch_size * dp in all), so every layout takes the same steps as one process with
batch_size * dp; rank 0 writes metrics, every rank logs to <log_dir>/rank_<r>/train.log. Checkpoints: one file
(single, DDP; FSDP gathers its shards into it), or, where the training state is sharded (ZeRO, tp, pp), a
torch.distributed.checkpoint folder every rank writes its shards into (course_lib.checkpoint.distributed).

Resuming restores model, optimizer, scheduler, GradScaler, every RNG and the data position, so the
continued run's losses equal an uninterrupted run's bit for bit (same device, threads and torch version). A file
checkpoint resumes on another number of ranks too: the global batch stays, each replica takes its share.

On a cluster: SIGTERM or SIGUSR1 (Slurm's warning before the time limit, `#SBATCH --signal=USR1@120`) ends the run
after the current step with a checkpoint there, requeues a Slurm job (`scontrol requeue`) and exits 0; --timeout_s
sets the collective timeout (default 10 minutes with NCCL); relative out_dir, log_dir and data_dir go under
$COURSE_OUTPUT_ROOT when it is set (a scratch file system).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from contextlib import nullcontext
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
from course_lib.checkpoint.distributed import (
    load_distributed_checkpoint,
    resolve_distributed_resume,
    save_distributed_checkpoint,
)
from course_lib.checkpoint.fsdp import load_full_checkpoint, save_full_checkpoint
from course_lib.core.config import add_dataclass_arguments, load_model_config
from course_lib.core.data import RandomBatches, load_tokens, synthetic_tokens
from course_lib.core.device import DEVICE_CHOICES, PRECISION_CHOICES, autocast_dtype, needs_grad_scaler, select_device
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPT, PRESETS, GPTConfig
from course_lib.core.optim import make_scheduler
from course_lib.core.steps import train_step
from course_lib.parallel.layout import DDP_IMPLEMENTATIONS, ZERO_STAGES, Layout, build_mesh
from course_lib.parallel.compose import parallelize
from course_lib.pipeline_parallel.schedules import SCHEDULES
from course_lib.runtime.env import LaunchEnvironmentError, cleanup, init_distributed, setup_rank_logging
from course_lib.sharding import fsdp
from course_lib.sharding.fsdp import mixed_precision_policy, precision_of

DATASETS = ("corpus", "synthetic")


STRATEGIES = ("auto", "single", "ddp", "fsdp")
"""auto: the layout the flags and the job's ranks give; single: one process; ddp, fsdp: shorthands for every
rank a replica (--fsdp: sharded), kept from before the layout flags."""
LAYOUT_FLAGS = {"dp": None, "tp": 1, "pp": 1, "zero": 0, "fsdp": False, "sp": False}
"""The layout fields that ask for more than one process, with their one-process values."""


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
    strategy: str = "auto"
    """auto (the layout below, one process when none is asked for), single (one process), ddp (every rank a
    replica) or fsdp (the same as --fsdp)."""
    dp: int | None = None
    """Data-parallel replicas; None: the ranks left after tp * pp (under torchrun, WORLD_SIZE / (tp * pp))."""
    zero: int = 0
    """ZeRO stage from scratch over the replicas (0-3): 1 shards optimizer states, 2 gradients too, 3 parameters too."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer states over the replicas with torch's FSDP2."""
    sharding: str = "FULL_SHARD"
    """fsdp: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD (course_lib.sharding.fsdp.SHARDING_STRATEGIES)."""
    ddp: str = "torch"
    """Replicas without sharding average gradients with torch DDP (torch) or the course's bucketed all-reduce (scratch)."""
    tp: int = 1
    """Tensor-parallel ranks (Megatron-LM with torch DTensor); n_head and ffn_hidden must divide by it."""
    sp: bool = False
    """Sequence parallelism on top of tp (norms and the residual stream split along the sequence)."""
    pp: int = 1
    """Pipeline stages (at most n_layer), one rank each."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b or gpipe."""
    micro_batches: int | None = None
    """Micro-batches each pipeline step splits a replica's batch_size * grad_accum_steps rows into; None: pp."""
    log_dir: str = "logs"
    """Distributed runs: every rank writes its log lines to <log_dir>/rank_<r>/train.log."""
    timeout_s: float | None = None
    """Seconds a collective may wait for the other ranks before the run fails; None: 600 with NCCL, 60 on gloo."""

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
            (("timeout_s",), "None or a positive number of seconds",
             lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)),
            (("min_lr",), f"between 0 and lr ({self.lr})", lambda v: 0 <= v <= self.lr),
            (("weight_decay", "grad_clip"), ">= 0", lambda v: v >= 0),
            (("model_size",), f"one of {sorted(PRESETS)} (or set config_path)",
             lambda v: self.config_path is not None or v in PRESETS),
            (("dataset",), f"one of {DATASETS}", lambda v: v in DATASETS),
            (("strategy",), f"one of {list(STRATEGIES)}", lambda v: v in STRATEGIES),
            (("dp", "micro_batches"), "None or a positive integer", lambda v: v is None or (is_int(v) and v > 0)),
            (("tp", "pp"), "a positive integer", lambda v: is_int(v) and v > 0),
            (("zero",), f"one of {list(ZERO_STAGES)}", lambda v: v in ZERO_STAGES),
            (("ddp",), f"one of {list(DDP_IMPLEMENTATIONS)}", lambda v: v in DDP_IMPLEMENTATIONS),
            (("schedule",), f"one of {sorted(SCHEDULES)}", lambda v: v in SCHEDULES),
            (("sharding",), f"one of {list(fsdp.SHARDING_STRATEGIES)}", lambda v: v in fsdp.SHARDING_STRATEGIES),
            (("precision",), f"one of {PRECISION_CHOICES}", lambda v: v in PRECISION_CHOICES),
            (("device",), f"one of {DEVICE_CHOICES} or cuda:N", lambda v: str(v).split(":")[0] in DEVICE_CHOICES),
            (("resume",), "True, False, 'auto' or a checkpoint path", lambda v: isinstance(v, (bool, str, Path))),
        ]
        for names, rule, ok in rules:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"TrainConfig.{name} must be {rule}, got {getattr(self, name)!r}")
        asked = [f"{name}={getattr(self, name)!r}" for name, alone in LAYOUT_FLAGS.items()
                 if getattr(self, name) not in (alone, 1 if name == "dp" else alone)]
        if self.strategy == "single" and asked:
            raise ValueError(f"TrainConfig.strategy='single' runs one process, but the layout asks for more "
                             f"({', '.join(asked)}): leave strategy at 'auto'")
        if self.strategy == "ddp" and (self.zero or self.fsdp or self.tp > 1 or self.pp > 1):
            raise ValueError("TrainConfig.strategy='ddp' means plain replicas: leave strategy at 'auto' to combine "
                             "zero, fsdp, tp or pp")

    @property
    def distributed(self) -> bool:
        """Does this run start a process group: a strategy or layout that asks for one, or torchrun's ranks."""
        asks = any(getattr(self, name) not in (alone, 1 if name == "dp" else alone)
                   for name, alone in LAYOUT_FLAGS.items())
        return self.strategy in ("ddp", "fsdp") or asks or (self.strategy == "auto" and
                                                            int(os.environ.get("WORLD_SIZE", "1")) > 1)

    def layout(self, world_size: int) -> Layout:
        """The Layout of this run on `world_size` ranks (dp filled in from it); raises naming what does not fit."""
        return Layout.for_world(world_size, dp=self.dp, zero=self.zero, fsdp=self.fsdp or self.strategy == "fsdp",
                                ddp=self.ddp, tp=self.tp, sp=self.sp, pp=self.pp, schedule=self.schedule,
                                micro_batches=self.micro_batches)


OUTPUT_ROOT_VARIABLE = "COURSE_OUTPUT_ROOT"
"""Where relative out_dir, log_dir and data_dir live when set (a cluster's scratch file system, e.g.
COURSE_OUTPUT_ROOT=$SCRATCH/course); unset: relative to the working folder."""


def output_path(path: str | os.PathLike) -> Path:
    """`path` under $COURSE_OUTPUT_ROOT when that is set and `path` is relative; `path` itself otherwise."""
    root = os.environ.get(OUTPUT_ROOT_VARIABLE)
    path = Path(path).expanduser()
    return Path(root).expanduser() / path if root and not path.is_absolute() else path


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))
"""What a scheduler sends before it ends a job: Slurm sends SIGTERM (scancel, preemption, the time limit) and,
with `#SBATCH --signal=USR1@120`, SIGUSR1 two minutes before the time limit."""


class StopRequest:
    """A signal handler that asks the training loop to stop after its current step (checkpointing there).

    A second signal of the same kind stops the process at once, the signal's usual effect."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __call__(self, signum, frame) -> None:
        if self.signum == signum:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name


def requeue_slurm_job() -> str:
    """`scontrol requeue $SLURM_JOB_ID`: the job goes back into the queue and, started again, resumes with
    --resume auto. Returns what happened, for the log."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not a Slurm job (no SLURM_JOB_ID): nothing requeued"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed: {err}"
    if done.returncode != 0:
        return f"scontrol requeue {job} failed: {(done.stderr or done.stdout).strip()}"
    return f"Slurm job {job} requeued (scontrol requeue)"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def data_vocab_size(cfg: TrainConfig) -> int | None:
    """The vocabulary of the token files cfg trains on (their meta.json's vocab_size); None for synthetic data or
    files that record none."""
    if cfg.dataset != "corpus":
        return None
    path = output_path(cfg.data_dir) / "meta.json"
    try:
        vocab = json.loads(path.read_text()).get("vocab_size") if path.exists() else None
    except (ValueError, AttributeError) as err:
        raise ValueError(f"{path} is not a JSON object describing the token files beside it: {err}") from err
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2):
        raise ValueError(f"{path} says vocab_size {vocab!r}: it must be an integer >= 2")
    return vocab


def build_model_config(cfg: TrainConfig) -> GPTConfig:
    """The model of --model_size (or --config_path), with --block_size, and a vocabulary the data fits.

    Token files of a trained tokenizer (meta.json: vocab_size 8192, say) need more ids than the presets' 256
    bytes: a preset then gets the data's vocabulary, rounded up to a multiple of 64 (the matrix shapes GPUs run
    fastest; the ids above the tokenizer's are never seen). A --config_path file keeps its own vocab_size, which
    check_splits refuses if the data holds a larger id.
    """
    overrides = {} if cfg.block_size is None else {"block_size": cfg.block_size}
    if cfg.config_path is not None:
        return load_model_config(cfg.config_path, **overrides)
    vocab = data_vocab_size(cfg)
    if vocab is not None and vocab > PRESETS[cfg.model_size].vocab_size:
        overrides["vocab_size"] = -(-vocab // 64) * 64
    return GPTConfig.from_preset(cfg.model_size, **overrides)


def load_splits(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens) as 1-D tensors."""
    if cfg.dataset == "synthetic":
        tokens = synthetic_tokens(SYNTHETIC_NUM_TOKENS, seed=0)  # fixed data; cfg.seed varies init and order
        split = int(0.9 * len(tokens))
        return tokens[:split], tokens[split:]
    data_dir = output_path(cfg.data_dir)
    return load_tokens("train", data_dir), load_tokens("val", data_dir)


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
        where = "the synthetic dataset" if cfg.dataset == "synthetic" else str(output_path(cfg.data_dir) / f"{split}.bin")
        if len(tokens) < config.block_size:
            raise ValueError(f"block_size={config.block_size} does not fit the {split} split: {where} holds "
                             f"{len(tokens):,} tokens; use a smaller --block_size or more data")
        top = int(tokens.max())
        if top >= config.vocab_size:
            raise ValueError(f"vocab_size={config.vocab_size} is too small for {where}: it holds token id {top}; set "
                             f"vocab_size to at least {top + 1} (the tokenizer's vocabulary, in meta.json beside it)")


def rows_on_resume(cfg: TrainConfig, dp: int, saved_global: int | None, saved_flag: int | None, path,
                   say=None) -> int:
    """Rows per replica of a resumed run: --batch_size, unless the checkpoint's run had another number of replicas.

    Then the global batch stays what it was (the same data, the same steps, the same learning-rate schedule) and
    each of the dp replicas takes its share of it: 8 rows from 2 ranks x 4 continue as 4 ranks x 2. A changed
    --batch_size is refused (it would change the run, not only where it runs).
    """
    if saved_global is None or saved_global == cfg.batch_size * dp:
        return cfg.batch_size
    if saved_flag != cfg.batch_size:
        raise ValueError(f"{path} was written by a run with a global batch of {saved_global} rows (--batch_size "
                         f"per replica x replicas); this run has --batch_size {cfg.batch_size} x {dp} replica(s) = "
                         f"{cfg.batch_size * dp}: resume with the same global batch"
                         + (f" (--batch_size {saved_flag}; on another number of ranks each replica then takes its "
                            "share of it)" if saved_flag else ""))
    if saved_global % dp:
        raise ValueError(f"{path} holds a global batch of {saved_global} rows, which {dp} replicas cannot share "
                         f"equally: resume on a number of data-parallel replicas that divides {saved_global}")
    rows = saved_global // dp
    if say:
        say(f"note: {path} was written with a global batch of {saved_global} rows; on {dp} replica(s) each now takes "
            f"{rows} rows (--batch_size {cfg.batch_size} was per replica on the earlier ranks), so the global batch, "
            "the data order and the schedule stay as they were")
    return rows


@dataclass(frozen=True)
class Checkpoints:
    """How a layout's run saves and resumes: one file from rank 0 (single, DDP), one file FSDP's ranks gather
    into, or a distributed checkpoint folder every rank writes its shards into (ZeRO, tp, pp)."""

    kind: str  # "file", "gathered" or "distributed"

    @classmethod
    def of(cls, layout: Layout) -> "Checkpoints":
        if layout.fsdp and layout.tp == 1:
            return cls("gathered")
        return cls("distributed" if layout.sharded else "file")

    @property
    def every_rank_saves(self) -> bool:
        return self.kind != "file"

    def resolve(self, resume, out_dir: Path) -> Path | None:
        return resolve_distributed_resume(resume, out_dir) if self.kind == "distributed" else resolve_resume(resume, out_dir)

    def save(self, out_dir: Path, par, *, layout: Layout, **state) -> Path:
        if self.kind == "distributed":
            state.pop("optimizer")
            return save_distributed_checkpoint(out_dir, state=par.state_dict(), layout=layout.name(), **state)
        save = save_full_checkpoint if self.kind == "gathered" else save_training_checkpoint
        return save(out_dir, model=par.model, **state)

    def load(self, path: Path, par, *, layout: Layout, optimizer, scheduler, scaler) -> dict:
        if self.kind == "distributed":
            state = par.state_dict()
            meta = load_distributed_checkpoint(path, state=state, layout=layout.name(), scheduler=scheduler,
                                               scaler=scaler)
            par.load_state_dict(state)
            return meta
        load = load_full_checkpoint if self.kind == "gathered" else load_checkpoint
        return load(path, model=par.model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)


def train(cfg: TrainConfig, stop: StopRequest | None = None) -> dict:
    """Run (or continue) training; returns history, evals, model and paths (see the end of the function).

    stop: a StopRequest whose signal ends the run after the current step, with a checkpoint there (result
    "stopped_by" names the signal); None: signals keep their usual effect."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    rank, world_size, rank_log = 0, 1, None
    if cfg.distributed:
        info = init_distributed(device="auto" if cfg.device in ("auto", "mps") else cfg.device.split(":")[0],
                                timeout_s=cfg.timeout_s)
        rank, world_size, device = info.rank, info.world_size, info.device
        rank_log = setup_rank_logging(output_path(cfg.log_dir), console=False)  # the console has rank 0's bar
    else:
        device = select_device(cfg.device)
    layout = cfg.layout(world_size)
    is_main = rank == 0
    amp_dtype = autocast_dtype(device, cfg.precision)
    if layout.pp > 1 and amp_dtype is not None:
        raise ValueError(f"TrainConfig.precision={cfg.precision!r} means autocast to {amp_dtype} on {device.type}, "
                         "but the pipeline stages pass fp32 activations: use --precision fp32 with --pp")
    out_dir = output_path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        remove_partial_files(out_dir)
    seed_everything(cfg.seed)
    config = build_model_config(cfg)
    if is_main and cfg.config_path is None and config.vocab_size != PRESETS[cfg.model_size].vocab_size:
        tqdm.write(f"note: vocab_size {config.vocab_size} for the {data_vocab_size(cfg):,} token ids of "
                   f"{output_path(cfg.data_dir) / 'meta.json'} (the {cfg.model_size} preset has "
                   f"{PRESETS[cfg.model_size].vocab_size})")
    model = GPT(config).to(device)
    num_params = model.num_params()  # before any layout keeps only a part of it here
    scaler = torch.amp.GradScaler(device.type) if needs_grad_scaler(device, amp_dtype) else None
    mesh = build_mesh(layout, device.type) if cfg.distributed else None
    # FSDP casts for compute itself (its mixed-precision policy), so no autocast on top.
    par = parallelize(model, layout, mesh, fsdp_strategy=cfg.sharding,
                      mp_policy=mixed_precision_policy(precision_of(amp_dtype)) if layout.fsdp else None)
    if layout.fsdp:
        amp_dtype = None
    optimizer = par.make_optimizer(cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                               max_steps=cfg.max_steps)
    checkpoints = Checkpoints.of(layout)
    train_tokens, val_tokens = load_splits(cfg)
    check_splits(cfg, config, {"train": train_tokens, "val": val_tokens})  # before step 1, not at the first eval
    rows = cfg.batch_size  # rows of a micro-batch on each replica
    start_step, resume_from = 0, checkpoints.resolve(cfg.resume, out_dir)
    if resume_from is not None:
        ckpt = checkpoints.load(resume_from, par, layout=layout, optimizer=optimizer, scheduler=scheduler,
                                scaler=scaler)
        saved_config = (ckpt.get("extra") or {}).get("train_config") or {}
        rows = rows_on_resume(cfg, layout.dp, (ckpt["data_state"] or {}).get("batch_size"),
                              saved_config.get("batch_size"), resume_from, say=tqdm.write if is_main else None)
        start_step = ckpt["step"]
        changes = continue_schedule(cfg, optimizer, scheduler, saved_config)
        if changes and is_main:
            tqdm.write(f"note: resuming {resume_from} at step {start_step} with {', '.join(changes)}: applied from "
                       f"step {start_step + 1} on (lr now {optimizer.param_groups[0]['lr']:.3g})")
    elif is_main and (moved := move_earlier_run(out_dir)):  # else --resume would later pick up the old run's latest.pt
        tqdm.write(f"note: fresh run in {out_dir}: the earlier run's checkpoints and metrics were moved to {moved} "
                   "(use --resume to continue a run instead)")
    # Every rank draws the same global batch; each replica keeps its own rows: disjoint data, one process's order.
    batches = RandomBatches(train_tokens, rows * layout.dp, config.block_size, seed=cfg.seed)
    if resume_from is not None:
        batches.load_state_dict(ckpt["data_state"])
    my_rows = slice(par.dp_rank * rows, (par.dp_rank + 1) * rows)
    last_step = cfg.stop_at_step or cfg.max_steps
    if world_size > 1:
        dist.barrier()  # rank 0 has cleared or checked out_dir before anyone writes
    tokens_per_step = rows * cfg.grad_accum_steps * config.block_size * layout.dp
    train_config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    train_config["rows_per_replica"] = rows  # --batch_size, or its share of a resumed run's global batch
    history, evals, ckpt_path, stopped_by = [], [], None, None
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard,
                           resume_step=start_step if resume_from else None) if is_main else None
    bar = tqdm(total=last_step, initial=start_step, desc="train", unit="step", disable=not cfg.progress or not is_main,
               dynamic_ncols=True)

    def save(step: int, val_loss: float | None) -> Path | None:
        if not (checkpoints.every_rank_saves or is_main):
            return None
        return checkpoints.save(out_dir, par, layout=layout, step=step, keep_last=cfg.keep_last, optimizer=optimizer,
                                scheduler=scheduler, scaler=scaler, data_state=batches.state_dict(),
                                extra={"train_config": train_config, "val_loss": val_loss})

    try:
        for step in range(start_step + 1, last_step + 1):  # `step` = optimizer steps done after this iteration
            start = time.perf_counter()
            micro_batches = [next(batches)[my_rows].to(device) for _ in range(cfg.grad_accum_steps)]
            stats = train_step(par, micro_batches, optimizer, scheduler, scaler=scaler, grad_clip=cfg.grad_clip,
                               amp_dtype=amp_dtype)
            stop_asked = float(stop is not None and stop.signum is not None)  # a signal has arrived here
            if world_size > 1:  # the replicas saw different rows: report the mean loss of the global batch
                stats["local_loss"] = stats["loss"]
                # the same all-reduce tells every rank whether any rank was asked to stop: they stop together
                loss = torch.tensor([stats["loss"], stop_asked], dtype=torch.float64, device=device)
                dist.all_reduce(loss)  # the ranks of one replica hold its loss once each: the mean is the same
                total_loss, stop_asked = loss.tolist()
                stats["loss"] = total_loss / world_size
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
            checkpoint_due = (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == last_step
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == last_step:
                try:
                    val_loss = par.evaluate(val_tokens, batch_size=rows * layout.dp,
                                            block_size=config.block_size, max_batches=cfg.eval_batches,
                                            amp_dtype=amp_dtype)
                except Exception:
                    if checkpoint_due:
                        save(step, None)  # the steps are done and paid for: keep them before the error ends the run
                    raise
                evals.append({"kind": "eval", "step": step, "val_loss": val_loss})
                if logger:
                    logger.log(evals[-1])
                if rank_log:
                    rank_log.info(f"step {step} | val loss {val_loss:.4f}")
                if cfg.log_interval and is_main:
                    bar.write(f"step {step:6d} | val loss {val_loss:.4f}")
            if checkpoint_due:
                ckpt_path = save(step, evals[-1]["val_loss"] if evals else None) or ckpt_path
                if world_size > 1:
                    dist.barrier()  # nobody reads latest.pt before rank 0 has finished writing it
            if stop_asked:
                if not checkpoint_due:
                    ckpt_path = save(step, evals[-1]["val_loss"] if evals else None) or ckpt_path
                    if world_size > 1:
                        dist.barrier()
                stopped_by = (stop.name if stop and stop.name else "a signal to another rank")
                if rank_log:
                    rank_log.info(f"step {step} | stopped by {stopped_by}: checkpoint written")
                break
    finally:
        bar.close()
        if logger:
            logger.close()
    step_times = [r["step_time_s"] for r in history[3:] or history]  # the first steps warm up allocators
    return {
        "history": history, "evals": evals, "model": par.model, "model_config": config, "config": cfg,
        "layout": layout, "parallel": par, "num_params": num_params,
        "start_step": start_step, "final_step": history[-1]["step"] if history else start_step,
        "final_val_loss": evals[-1]["val_loss"] if evals else None, "device": str(device),
        "median_tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
        "out_dir": out_dir, "checkpoint": ckpt_path, "metrics_path": logger.path if logger else None,
        "rank": rank, "world_size": world_size, "stopped_by": stopped_by,
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


INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError, LaunchEnvironmentError)
"""What bad input raises (a config field, a data file, a checkpoint that does not fit): one clear line on the CLI."""


def main(argv=None, *, stop_on_signals: bool = True) -> dict:
    """The CLI. stop_on_signals: SIGTERM and SIGUSR1 end the run after the current step with a checkpoint there,
    then exit 0 (in a Slurm job, after `scontrol requeue`); run_cli leaves them to its launcher."""
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an input error")
    args = parser.parse_args(argv)
    debug = args.__dict__.pop("debug")
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    owns_group = cfg.distributed and not dist.is_initialized()  # a launcher's group outlives this run
    try:
        with StopRequest() if stop_on_signals else nullcontext() as stop:
            result = train(cfg, stop)
    except INPUT_ERRORS as err:
        if debug:
            raise
        parser.exit(2, f"{parser.prog}: error: {err}\n(--debug shows where it was raised)\n")
    finally:
        if owns_group:
            cleanup()
    if result["rank"] != 0:
        return result
    val = result["final_val_loss"]
    ranks = f" x {result['world_size']} ranks" if result["world_size"] > 1 else ""
    layout = f" (layout {result['layout'].name()})" if result["world_size"] > 1 else ""
    print(f"{result['num_params']:,}-parameter model on {result['device']}{ranks}: steps {result['start_step']} -> "
          f"{result['final_step']}" + (f", final val loss {val:.4f}" if val is not None else "") + layout)
    if result["median_tokens_per_s"]:
        print(f"median {result['median_tokens_per_s']:,.0f} tokens/s ({torch.get_num_threads()} threads)")
    print(f"checkpoint: {result['checkpoint']}; metrics: {result['metrics_path']}")
    if result["stopped_by"]:
        print(f"stopped by {result['stopped_by']} after step {result['final_step']} of {cfg.max_steps}; "
              f"{requeue_slurm_job()}; continue with --resume (or --resume auto)", flush=True)
    return result


def run_cli(argv: list[str]) -> dict:
    """main(argv) on this rank, returning what can travel back to a launcher (course_lib.runtime.launch): the
    per-step records, the evaluations, the steps run, the checkpoint and the layout's name.

        launch(run_cli, 8, args=(["--dp", "2", "--tp", "2", "--pp", "2", "--max_steps", "20"],))
    """
    result = main(argv, stop_on_signals=False)  # SIGUSR1 is the launcher's "where are you?" (a stack dump)
    return {"history": result["history"], "evals": result["evals"], "start_step": result["start_step"],
            "final_step": result["final_step"], "layout": result["layout"].name(), "rank": result["rank"],
            "checkpoint": None if result["checkpoint"] is None else str(result["checkpoint"])}


if __name__ == "__main__":
    main()

"""The course's training loop under DeepSpeed: ZeRO stages 1-3 and CPU/NVMe offload, chosen by a JSON file.

    deepspeed --num_gpus 8 --module course_lib.integrations.deepspeed_train --deepspeed_config config/deepspeed_zero2.json
    deepspeed --num_gpus 2 --module course_lib.integrations.deepspeed_train --deepspeed_config config/deepspeed_zero3.json \\
        --max_steps 20 --batch_size 4 --dataset synthetic            # a CPU: two processes over gloo
    torchrun --nproc_per_node 2 -m course_lib.integrations.deepspeed_train --deepspeed_config config/deepspeed_zero1.json
    python -m course_lib.integrations.deepspeed_train --deepspeed_config config/deepspeed_zero2.json --max_steps 5   # one rank

The JSON file (book/cluster/deepspeed.md explains every line) decides what DeepSpeed owns: ZeRO stage and
offload, precision, optimizer, LR schedule, clipping and batch sizes. The course's training flags (every
`python -m course_lib.train` flag) choose the model, the data, the run length and the output folder; a
flag given on the command line also overrides the JSON field that means the same thing:

    --batch_size -> train_micro_batch_size_per_gpu      --lr           -> optimizer.params.lr
    --grad_accum_steps -> gradient_accumulation_steps   --weight_decay -> optimizer.params.weight_decay
    --grad_clip  -> gradient_clipping                   --max_steps    -> scheduler.params.total_num_steps
    --warmup_steps -> scheduler.params.warmup_num_steps --min_lr       -> scheduler.params.cos_min_ratio * lr
    --precision fp32 | bf16 | fp16 -> bf16.enabled / fp16.enabled

train_batch_size must equal micro batch x accumulation x world size; when the file's value was written for
another world size (the course's files assume 8 GPUs) it is recomputed, with a note. As everywhere in the
course, precision "auto" means the file's setting on a GPU and fp32 on a CPU. The `deepspeed` launcher passes
--local_rank=<n> in argv; the parser accepts it (course_lib.train.build_parser).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.core.data import RandomBatches
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPT
from course_lib.core.optim import param_groups
from course_lib.core.steps import evaluate
from course_lib.runtime.env import cleanup, init_distributed
from course_lib.train import (TrainConfig, build_model_config, build_parser, config_from_args, load_splits,
                              seed_everything)

# TrainConfig field -> where the same setting lives in a DeepSpeed config.
FLAG_TO_DEEPSPEED = {
    "batch_size": ("train_micro_batch_size_per_gpu",),
    "grad_accum_steps": ("gradient_accumulation_steps",),
    "grad_clip": ("gradient_clipping",),
    "lr": ("optimizer", "params", "lr"),
    "weight_decay": ("optimizer", "params", "weight_decay"),
    "max_steps": ("scheduler", "params", "total_num_steps"),
    "warmup_steps": ("scheduler", "params", "warmup_num_steps"),
}


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def json_precision(ds_config: dict) -> str:
    """'bf16', 'fp16' or 'fp32': the precision a DeepSpeed config asks for."""
    if _get(ds_config, ("bf16", "enabled")):
        return "bf16"
    if _get(ds_config, ("fp16", "enabled")):
        return "fp16"
    return "fp32"


def resolve_configs(ds_config: dict, explicit: dict, world_size: int,
                    on_gpu: bool) -> tuple[TrainConfig, dict, list[str]]:
    """(TrainConfig, DeepSpeed config, notes) that agree with each other.

    `explicit` holds the TrainConfig fields given on the command line: they win over the file. Every other
    field of FLAG_TO_DEEPSPEED is taken from the file, so the course's logging and data code see the values
    DeepSpeed uses.
    """
    ds_config = copy.deepcopy(ds_config)
    notes = []
    values = dict(explicit)
    if "max_steps" in explicit and "warmup_steps" not in explicit:  # a shorter run gets a shorter warmup
        explicit = {**explicit, "warmup_steps": max(1, explicit["max_steps"] // 10)}
        values["warmup_steps"] = explicit["warmup_steps"]
    for field, path in FLAG_TO_DEEPSPEED.items():
        if field in explicit:
            _set(ds_config, path, explicit[field])
        elif _get(ds_config, path) is not None:
            values[field] = _get(ds_config, path)
    if "min_lr" in explicit:  # DeepSpeed's cosine ends at cos_min_ratio * lr
        _set(ds_config, ("scheduler", "params", "cos_min_ratio"), explicit["min_lr"] / values.get("lr", TrainConfig.lr))
    elif _get(ds_config, ("scheduler", "params", "cos_min_ratio")) is not None:
        values["min_lr"] = _get(ds_config, ("scheduler", "params", "cos_min_ratio")) * values.get("lr", TrainConfig.lr)
    precision = explicit.get("precision", "auto")
    if precision == "auto":
        precision = json_precision(ds_config) if on_gpu else "fp32"  # the course's rule: fp32 on a CPU
    ds_config.setdefault("bf16", {})["enabled"] = precision == "bf16"
    ds_config.setdefault("fp16", {})["enabled"] = precision == "fp16"
    values["precision"] = precision
    cfg = TrainConfig(**values)
    if _get(ds_config, ("scheduler", "type")) == "WarmupCosineLR" and cfg.warmup_steps < 1:
        raise ValueError("DeepSpeed's WarmupCosineLR needs warmup_steps >= 1 (scheduler.params.warmup_num_steps)")
    micro, accum = cfg.batch_size, cfg.grad_accum_steps
    wanted = micro * accum * world_size  # DeepSpeed refuses any other train_batch_size
    if ds_config.get("train_batch_size") not in (None, wanted):
        notes.append(f"train_batch_size {ds_config['train_batch_size']} in the config does not fit this job: "
                     f"{micro} (micro batch) x {accum} (accumulation) x {world_size} (ranks) = {wanted}")
    ds_config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=wanted)
    offloaded = _get(ds_config, ("zero_optimization", "offload_optimizer", "device")) in ("cpu", "nvme")
    if not on_gpu and _get(ds_config, ("optimizer", "type")) in ("Adam", "AdamW") and not offloaded:
        # DeepSpeed's fused Adam is a GPU kernel (on a CPU it is first compiled, for minutes); torch's AdamW
        # computes the same update.
        _set(ds_config, ("optimizer", "params", "torch_adam"), True)
    return cfg, ds_config, notes


def explicit_flags(parser: argparse.ArgumentParser, argv) -> dict:
    """The TrainConfig fields that appear on the command line (a second parse in which nothing has a default)."""
    quiet = copy.deepcopy(parser)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return {k: v for k, v in vars(quiet.parse_args(argv)).items() if k in TrainConfig.__dataclass_fields__}


def train_with_deepspeed(cfg: TrainConfig, ds_config: dict) -> dict:
    import deepspeed

    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.seed)
    config = build_model_config(cfg)
    model = GPT(config)
    # The course's two AdamW groups (no weight decay on norms): DeepSpeed builds its optimizer over them.
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.weight_decay),
                                                   config=ds_config)
    stage = engine.zero_optimization_stage()
    train_tokens, val_tokens = load_splits(cfg)
    # As in course_lib.train: every rank draws the same global batch and keeps its own rows.
    batches = RandomBatches(train_tokens, cfg.batch_size * world_size, config.block_size, seed=cfg.seed)
    my_rows = slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
    out_dir = Path(cfg.out_dir)
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard) if rank == 0 else None
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * config.block_size * world_size
    history, evals = [], []
    for step in range(1, cfg.max_steps + 1):
        start = time.perf_counter()
        lr = engine.get_lr()[0]
        losses = []
        for _ in range(cfg.grad_accum_steps):  # engine.step() updates only at the accumulation boundary
            idx = next(batches)[my_rows].to(engine.device)
            _, loss = engine(idx, targets=idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        mean_loss = torch.stack(losses).mean().reshape(1).to(torch.float64)
        dist.all_reduce(mean_loss)
        record = {"kind": "train", "step": step, "loss": mean_loss.item() / world_size, "lr": lr,
                  "zero_stage": stage, "tokens_per_s": tokens_per_step / (time.perf_counter() - start)}
        history.append(record)
        if logger:
            logger.log(record)
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.max_steps:
            # Under ZeRO-3 every forward gathers parameters collectively, so every rank must run the same
            # forwards: each evaluates all batches instead of its share.
            shards = (0, 1) if stage == 3 else (rank, world_size)
            val_loss = evaluate(engine.module, val_tokens, batch_size=cfg.batch_size * world_size,
                                block_size=config.block_size, max_batches=cfg.eval_batches, rank=shards[0],
                                world_size=shards[1])
            evals.append({"kind": "eval", "step": step, "val_loss": val_loss})
            if logger:
                logger.log(evals[-1])
        if cfg.log_interval and step % cfg.log_interval == 0 and rank == 0:
            print(f"step {step:5d} | loss {record['loss']:.4f} | lr {lr:.2e} | {record['tokens_per_s']:,.0f} tok/s")
    # DeepSpeed's own checkpoint: one file of model states plus one optimizer shard per rank (ZeRO).
    engine.save_checkpoint(str(out_dir / "deepspeed"), tag=f"step{cfg.max_steps}",
                           client_state={"data_state": batches.state_dict(), "step": cfg.max_steps})
    if logger:
        logger.close()
    return {"history": history, "evals": evals, "rank": rank, "world_size": world_size, "zero_stage": stage,
            "engine": engine, "scheduler": scheduler, "checkpoint_dir": out_dir / "deepspeed"}


def build_deepspeed_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = "python -m course_lib.integrations.deepspeed_train"
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config, e.g. config/deepspeed_zero2.json")
    return parser


DEEPSPEED_MISSING = "DeepSpeed is not installed: make venv EXTRAS=deepspeed (or pip install -r requirements-deepspeed.txt)"


def main(argv=None) -> dict:
    parser = build_deepspeed_parser()
    try:
        import deepspeed
    except ImportError:
        parser.exit(2, f"{parser.prog}: error: {DEEPSPEED_MISSING}\n")

    args = parser.parse_args(argv)
    explicit = explicit_flags(parser, argv)
    config_from_args(args)  # validates the flags, and copies --local_rank to $LOCAL_RANK
    path = Path(args.deepspeed_config)
    if not path.is_file():
        parser.error(f"--deepspeed_config {path}: no such file (the course's are config/deepspeed_zero*.json)")
    try:
        file_config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        parser.error(f"{path} is not valid JSON: {err.msg} at line {err.lineno}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    # The course's rank setup (torchrun, the deepspeed launcher, or one plain process); DeepSpeed adopts the group.
    info = init_distributed(device="cuda" if on_gpu else "cpu")
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))  # DeepSpeed insists on it, even for one process
    deepspeed.init_distributed()
    try:
        cfg, ds_config, notes = resolve_configs(file_config, explicit, dist.get_world_size(), on_gpu)
    except ValueError as err:
        parser.error(str(err))
    if dist.get_rank() == 0:
        for note in notes:
            print(f"note: {note}")
    result = train_with_deepspeed(cfg, ds_config)
    if result["rank"] == 0:
        last = result["history"][-1]
        print(f"DeepSpeed ZeRO-{result['zero_stage']}: {result['world_size']} rank(s), {cfg.precision}, steps 1 -> "
              f"{last['step']}, loss {last['loss']:.4f}, val loss {result['evals'][-1]['val_loss']:.4f}; "
              f"checkpoint: {result['checkpoint_dir']}")
    cleanup()
    return result


if __name__ == "__main__":
    main()
    # The run is over and saved, and the process group destroyed. DeepSpeed's CPU communication op can still hold
    # a native thread, whose destructor at interpreter exit aborts the process ("terminate called without an
    # active exception", SIGABRT), now and then: the launcher would report a finished run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

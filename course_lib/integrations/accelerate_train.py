"""The course's training loop written with Hugging Face Accelerate.

    python scripts/accelerate_train.py --max_steps 20                                   # one process
    accelerate launch --multi_gpu --num_processes 2 scripts/accelerate_train.py --max_steps 20

`Accelerator` places the model on the right device, wraps it in DistributedDataParallel when several processes
run, and turns `backward`, gradient accumulation and metric gathering into one-liners; the same script then
runs on a GPU node with `accelerate launch --multi_gpu --num_processes 8`. On a CPU-only machine beware:
`accelerate launch --cpu --num_processes 2` silently runs ONE process; `--multi_gpu` starts real ranks (gloo).

With the same TrainConfig, the losses equal course_lib.train's DDP trainer (tests/data_parallel/test_torch_ddp.py): both
split one global batch over the ranks and use the same optimizer, schedule and clipping.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from course_lib.core.data import RandomBatches
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPT
from course_lib.core.optim import configure_optimizer, make_scheduler
from course_lib.core.steps import evaluate
from course_lib.runtime.env import check_one_gpu_per_rank, rank_device
from course_lib.train import (
    TrainConfig,
    build_model_config,
    build_parser,
    config_from_args,
    load_splits,
    seed_everything,
)

PRECISION_TO_ACCELERATE = {"auto": "no", "fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def train_with_accelerate(cfg: TrainConfig) -> dict:
    import os

    from accelerate import Accelerator

    # Without cpu=True on a machine with no GPU, Accelerate ignores the launcher's ranks and every process
    # trains alone (another silent single-process trap); so say "cpu" whenever the ranks do not get a GPU each:
    # the same rule as course_lib.train ("auto" takes the GPUs only when every local rank has one; 2 ranks on a
    # 1-GPU node train on the CPU over gloo instead of failing in NCCL).
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_cpu = rank_device(local_rank, cfg.device, local_world_size).type == "cpu"
    if not on_cpu:
        check_one_gpu_per_rank("nccl", local_world_size)
    accelerator = Accelerator(
        cpu=on_cpu,
        mixed_precision=PRECISION_TO_ACCELERATE[cfg.precision],
        gradient_accumulation_steps=cfg.grad_accum_steps,
        # By default Accelerate steps a prepared scheduler once per process per step; we step it ourselves.
        step_scheduler_with_optimizer=False,
    )
    rank, world_size = accelerator.process_index, accelerator.num_processes
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world_size:
        raise RuntimeError(f"the launcher started WORLD_SIZE={launched} processes but Accelerate sees {world_size}: "
                           "each would train alone. Use --device cpu on a machine without GPUs.")
    seed_everything(cfg.seed)
    config = build_model_config(cfg)
    model = GPT(config)
    optimizer = configure_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = make_scheduler(optimizer, max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                               max_steps=cfg.max_steps)
    model, optimizer = accelerator.prepare(model, optimizer)  # device placement + DDP when world_size > 1
    train_tokens, val_tokens = load_splits(cfg)
    batches = RandomBatches(train_tokens, cfg.batch_size * world_size, config.block_size, seed=cfg.seed)
    my_rows = slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
    out_dir = Path(cfg.out_dir)
    logger = MetricsLogger(out_dir, tensorboard=False) if accelerator.is_main_process else None
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * config.block_size * world_size
    history, evals = [], []
    for step in range(1, cfg.max_steps + 1):
        start = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        losses = []
        for _ in range(cfg.grad_accum_steps):
            idx = next(batches)[my_rows].to(accelerator.device)
            with accelerator.accumulate(model):  # no_sync on all but the last micro-batch
                _, loss = model(idx, targets=idx)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
                optimizer.step()  # a no-op until the last micro-batch
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
        scheduler.step()
        # The mean over ranks of each rank's mean micro-batch loss: the loss of the global batch.
        global_loss = accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item()
        elapsed = time.perf_counter() - start
        record = {"kind": "train", "step": step, "loss": global_loss, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed}
        history.append(record)
        if logger:
            logger.log(record)
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.max_steps:
            val_loss = evaluate(accelerator.unwrap_model(model), val_tokens, batch_size=cfg.batch_size * world_size,
                                block_size=config.block_size, max_batches=cfg.eval_batches, rank=rank,
                                world_size=world_size)
            evals.append({"kind": "eval", "step": step, "val_loss": val_loss})
            if logger:
                logger.log(evals[-1])
        if cfg.log_interval and step % cfg.log_interval == 0:
            accelerator.print(f"step {step:5d} | loss {global_loss:.4f} | lr {lr:.2e} | "
                              f"{record['tokens_per_s']:,.0f} tok/s ({world_size} processes)")
    if logger:
        logger.close()
    # A plain barrier, not accelerator.wait_for_everyone(): that passes device_ids=[local rank] to the barrier,
    # which names cuda:1 on a 1-GPU node even when the ranks run on the CPU.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    step_times = [r["step_time_s"] for r in history[3:] or history]
    result = {"history": history, "evals": evals, "rank": rank, "world_size": world_size,
              "device": str(accelerator.device), "median_tokens_per_s": tokens_per_step / statistics.median(step_times)}
    # Drop Accelerate's references to the DDP-wrapped model now, so that it is not collected after main() has
    # destroyed the process group (a reducer torn down at interpreter exit can abort the process).
    accelerator.free_memory()
    return result


def main(argv=None) -> dict:
    parser = build_parser()
    parser.prog = "scripts/accelerate_train.py"
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    result = train_with_accelerate(cfg)
    if result["rank"] == 0:
        print(f"Accelerate: {result['world_size']} process(es) on {result['device']}, final loss "
              f"{result['history'][-1]['loss']:.4f}, val loss {result['evals'][-1]['val_loss']:.4f}, "
              f"median {result['median_tokens_per_s']:,.0f} tokens/s")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()

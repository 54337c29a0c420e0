"""Lab 2: data-parallel training written out in one file; N CPU processes act as N GPUs.

    torchrun --nproc_per_node=2 scripts/ddp_simulation_train.py
    torchrun --nproc_per_node=4 scripts/ddp_simulation_train.py --max_steps 60
    python scripts/ddp_simulation_train.py            # the same script as one process (world size 1)
    tail logs/rank_0/train.log logs/rank_1/train.log  # afterwards: what each rank saw and did
    torchrun --nproc_per_node=2 scripts/ddp_simulation_train.py --resume   # continue from runs/.../latest.pt

Everything distributed is on this page, in the order a job meets it:

1. `dist.init_process_group`: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the call
   reads them and connects the ranks (gloo on the CPU; NCCL for CUDA tensors on a GPU node).
2. The data: a Dataset whose items are the rows of every step's global batch, and a `DistributedSampler` that
   gives rank r every world_size-th row, so the ranks' rows are disjoint and together make the global batch.
   Step 1's rows are gathered and checked: that is the proof that the data is split.
3. `DistributedDataParallel` wraps the model; `loss.backward()` then averages the gradients over the ranks, so
   every replica takes the same optimizer step and stays equal to the others.
4. Each rank logs to logs/rank_<r>/train.log: its local loss (its own rows) next to the global one.
5. Checkpoints: rank 0 alone writes one (the replicas are equal) every --ckpt_interval steps, at the last step, and
   when SIGTERM arrives (a scheduler's time limit or preemption): the signal sets a flag, the flag rides in the
   step's loss all-reduce so that every rank stops after the same step, and the job exits 0. --resume continues
   from the checkpoint, bit for bit.
6. `dist.barrier()` and `dist.destroy_process_group()` end every rank the same way.

The model, the AdamW settings, the learning-rate schedule and the sequence of global batches are the ones of
`python -m course_lib.train`, so this run equals `torchrun ... -m course_lib.train --strategy ddp` with the same
flags, and one process with the whole global batch (tests/data_parallel/test_torch_ddp.py checks both).
"""

import argparse
import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from course_lib.checkpoint.atomic import LATEST, load_checkpoint, move_earlier_run, save_training_checkpoint
from course_lib.core.data import RandomBatches, load_tokens, prepare_tokens, synthetic_tokens
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPT, PRESETS, GPTConfig
from course_lib.core.optim import configure_optimizer, make_scheduler
from course_lib.core.steps import evaluate
from course_lib.train import SYNTHETIC_NUM_TOKENS, TrainConfig, seed_everything

DEFAULTS = TrainConfig()  # the same hyperparameters as `python -m course_lib.train`


class GlobalBatchRows(Dataset):
    """Item i = (i, window i): the rows of step 1's global batch, then step 2's, ... (steps x global_batch rows).

    The windows are drawn up front with the generator course_lib.train uses, so both runs see the same global
    batches. Which rank reads which row is the sampler's business, not the dataset's.
    """

    def __init__(self, tokens: torch.Tensor, global_batch: int, block_size: int, steps: int, seed: int):
        batches = RandomBatches(tokens, global_batch, block_size, seed=seed)
        self.windows = torch.cat([next(batches) for _ in range(steps)])  # (steps * global_batch, block_size)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        return i, self.windows[i]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_size", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8, help="rows per rank and step (global batch = x ranks)")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr)
    p.add_argument("--min_lr", type=float, help="default lr / 10")
    p.add_argument("--warmup_steps", type=int, help="default max_steps // 10")
    p.add_argument("--weight_decay", type=float, default=DEFAULTS.weight_decay)
    p.add_argument("--grad_clip", type=float, default=DEFAULTS.grad_clip)
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--dataset", default="corpus", choices=("corpus", "synthetic"))
    p.add_argument("--data_dir", default=DEFAULTS.data_dir)
    p.add_argument("--out_dir", default="runs/ddp_simulation")
    p.add_argument("--log_dir", default=DEFAULTS.log_dir, help="each rank writes <log_dir>/rank_<r>/train.log")
    p.add_argument("--log_interval", type=int, default=5)
    p.add_argument("--eval_interval", type=int, default=20, help="0: evaluate at the last step only")
    p.add_argument("--eval_batches", type=int, default=DEFAULTS.eval_batches)
    p.add_argument("--ckpt_interval", type=int, default=DEFAULTS.ckpt_interval, help="0: at the last step only")
    p.add_argument("--resume", action="store_true", help="continue from <out_dir>/latest.pt")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    p.add_argument("--no-progress", action="store_true", help="accepted for course_lib.train's flags; no bar here")
    args = p.parse_args(argv)
    for name in ("max_steps", "batch_size", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.warmup_steps = args.max_steps // 10 if args.warmup_steps is None else args.warmup_steps
    return args


def init_process_group() -> tuple[int, int, torch.device]:
    """1. Join the job torchrun started (or make a job of one for a plain `python script.py`)."""
    if "RANK" not in os.environ:  # no torchrun: one rank, so that the code below runs unchanged
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1, torch.device("cpu")
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:  # one GPU per rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")  # NCCL for CUDA tensors, gloo for CPU ones
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))  # ranks share the cores
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def rank_logger(log_dir: str, rank: int, world_size: int) -> logging.Logger:
    """4. Every rank writes its own file: logs/rank_<r>/train.log."""
    path = Path(log_dir) / f"rank_{rank}" / "train.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}/{world_size}] %(message)s"))
    log = logging.getLogger(f"ddp_simulation.rank{rank}")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return log


class StopSignal:
    """5. SIGTERM sets a flag; the training loop reads it after each step (never mid-step)."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame):
        self.requested = True


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world_size, device = init_process_group()
    stop = StopSignal()
    log = rank_logger(args.log_dir, rank, world_size)
    if rank == 0:
        print(f"DDP on {world_size} rank(s), {device.type}, global batch {args.batch_size} x {world_size} rows"
              if world_size > 1 else "one process (world size 1): start it with torchrun for several")

    # 2. The data. Rank 0 tokenizes the corpus once; the others wait at the barrier, then read the files.
    if args.dataset == "corpus":
        if rank == 0:
            prepare_tokens(args.data_dir, progress=False)
        dist.barrier()
        train_tokens, val_tokens = load_tokens("train", args.data_dir), load_tokens("val", args.data_dir)
    else:
        tokens = synthetic_tokens(SYNTHETIC_NUM_TOKENS, seed=0)
        train_tokens, val_tokens = tokens[:int(0.9 * len(tokens))], tokens[int(0.9 * len(tokens)):]
    config = GPTConfig.from_preset(args.model_size)
    global_batch = args.batch_size * world_size
    dataset = GlobalBatchRows(train_tokens, global_batch, config.block_size, args.max_steps, args.seed)
    # Rank r reads rows r, r + world_size, r + 2 world_size, ...: disjoint, and each step's rows come from that
    # step's global batch. shuffle=False keeps course_lib.train's order (the windows are random already); with
    # shuffle=True, call sampler.set_epoch(epoch) before every epoch, or every epoch repeats the first one's order.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    sampler.set_epoch(0)  # one pass over the run's rows
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    # 3. The same model on every rank (same seed), wrapped by DDP.
    seed_everything(args.seed)
    model = GPT(config).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = configure_optimizer(model, args.lr, args.weight_decay)
    scheduler = make_scheduler(optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                               max_steps=args.max_steps)
    out_dir = Path(args.out_dir)
    start_step = 0
    if args.resume:  # 5. every rank loads the same file: model, optimizer, schedule and step
        if not (out_dir / LATEST).exists():
            raise SystemExit(f"--resume: there is no checkpoint {out_dir / LATEST} to continue from")
        start_step = load_checkpoint(out_dir / LATEST, model=model, optimizer=optimizer, scheduler=scheduler,
                                     map_location=device)["step"]
        log.info(f"resumed from {out_dir / LATEST} at step {start_step}")
    metrics = None
    if rank == 0:
        moved = None if args.resume else move_earlier_run(out_dir)  # never overwrite an earlier run
        if moved:
            print(f"an earlier run in {out_dir} was moved to {moved}")
        metrics = MetricsLogger(out_dir, tensorboard=args.tensorboard, resume_step=start_step if args.resume else None)

    step = start_step
    for step, (rows, windows) in enumerate(loader, start=1):
        if step <= start_step:
            continue  # done before the checkpoint: the loader still walks its rows, so the next ones come next
        if step == 1:  # the proof that the data is split: gather every rank's row numbers
            everyone = [None] * world_size
            dist.all_gather_object(everyone, rows.tolist())
            assert sorted(sum(everyone, [])) == list(range(global_batch)), f"rows overlap or miss: {everyone}"
            log.info(f"step 1 rows of the global batch: mine {rows.tolist()}; all ranks {everyone}")
        windows = windows.to(device)
        lr = optimizer.param_groups[0]["lr"]
        _, loss = ddp(windows, targets=windows)
        loss.backward()  # DDP all-reduces (averages) the gradients during the backward pass
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # This rank's loss (its rows only) and its stop flag, summed over the ranks in one all-reduce: the mean loss
        # for the log, and a stop that every rank sees at the same step.
        shared = torch.tensor([loss.item(), float(stop.requested)], dtype=torch.float64, device=device)
        dist.all_reduce(shared)
        global_loss, stopping = shared[0].item() / world_size, shared[1].item() > 0
        if step % args.log_interval == 0 or step == args.max_steps:
            log.info(f"step {step} | loss {global_loss:.4f} | local loss {loss.item():.4f} | lr {lr:.2e} | "
                     f"grad norm {grad_norm.item():.3f}")
        if metrics:
            metrics.log({"kind": "train", "step": step, "loss": global_loss, "lr": lr, "grad_norm": grad_norm.item()})
        if (args.eval_interval and step % args.eval_interval == 0) or step == args.max_steps:
            val_loss = evaluate(model, val_tokens, batch_size=global_batch, block_size=config.block_size,
                                max_batches=args.eval_batches, rank=rank, world_size=world_size)
            log.info(f"step {step} | val loss {val_loss:.4f}")
            if metrics:
                metrics.log({"kind": "eval", "step": step, "val_loss": val_loss})
                print(f"step {step} | loss {global_loss:.4f} | val loss {val_loss:.4f}")
        if (args.ckpt_interval and step % args.ckpt_interval == 0) or step == args.max_steps or stopping:
            if rank == 0:  # the replicas are equal: rank 0 saves one copy; the others wait until it is complete
                save_training_checkpoint(out_dir, step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                                         extra={"world_size": world_size, "batch_size": args.batch_size})
            dist.barrier()
        if stopping:
            log.info(f"SIGTERM: stopped after step {step} with a checkpoint; continue with --resume")
            if rank == 0:
                print(f"stopped by SIGTERM after step {step}: checkpoint {out_dir / LATEST}; continue with --resume")
            break

    if rank == 0:
        metrics.close()
        print(f"checkpoint: {out_dir / LATEST} (step {step}); metrics: {metrics.path}; "
              f"rank logs: {args.log_dir}/rank_<r>/train.log")
    # 6. End every rank the same way.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

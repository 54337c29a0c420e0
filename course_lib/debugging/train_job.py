"""A data-parallel training job of the kind a team runs every day; the debugging lab's jobs are versions of it.

    torchrun --nproc_per_node=2 -m course_lib.debugging.train_job --out_dir runs/debugging/job
    torchrun --nproc_per_node=2 -m course_lib.debugging.train_job --out_dir runs/debugging/job --resume
    python -m course_lib.debugging.train_job --out_dir runs/debugging/one       # one process

Each rank reads its share of every global batch through a DistributedSampler, trains a small GPT wrapped in
DistributedDataParallel with gradient accumulation (no_sync on all but the last micro-batch) and optional
fp16 autocast with a GradScaler, and logs its loss, gradient norm and a checksum of its parameters. Every
`eval_every` steps the ranks evaluate on held-out windows; every `checkpoint_every` steps rank 0 writes a
checkpoint; at the end every rank reloads the last checkpoint into a fresh model for the test evaluation.
"""

from __future__ import annotations

import argparse
import os
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from course_lib.core.data import synthetic_tokens
from course_lib.core.model import GPT, GPTConfig


@dataclass
class JobConfig:
    out_dir: str = "runs/debugging/job"
    epochs: int = 2
    train_windows: int = 48        # training rows of block_size tokens
    val_windows: int = 12          # held-out rows
    block_size: int = 16
    micro_batch: int = 2           # rows per rank and micro-batch
    grad_accum: int = 2            # micro-batches per optimizer step
    lr: float = 3e-3
    precision: str = "fp32"        # "fp32" or "fp16" (autocast + loss scaling)
    eval_every: int = 4            # steps
    checkpoint_every: int = 4      # steps
    resume: bool = False           # start from out_dir/checkpoint.pt when it exists
    aux_loss_weight: float = 0.0   # > 0: also train the auxiliary head
    seed: int = 0

    def __post_init__(self):
        for name in ("epochs", "train_windows", "val_windows", "block_size", "micro_batch", "grad_accum",
                     "eval_every", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"JobConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.precision not in ("fp32", "fp16"):
            raise ValueError(f"JobConfig.precision must be 'fp32' or 'fp16', got {self.precision!r}")


class JobModel(GPT):
    """The course GPT with an auxiliary head (a bigram prediction of the next token from the embedding alone),
    built and trained when aux_loss_weight > 0."""

    def __init__(self, config, aux_loss_weight):
        super().__init__(config)
        self.aux_loss_weight = aux_loss_weight
        if aux_loss_weight > 0:
            self.aux_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        if targets is not None and self.aux_loss_weight > 0:
            aux_logits = self.aux_head(self.tok_emb(idx))
            aux = torch.nn.functional.cross_entropy(aux_logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
            loss = loss + self.aux_loss_weight * aux
        return logits, loss


def setup():
    """Join the job torchrun (or the course's launcher) started, a job of one for a plain `python`: one GPU per
    rank (NCCL) where every local rank has one, else the CPU (gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized():
        gpus = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        backend = "cpu:gloo,cuda:nccl" if gpus else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def build_data(config):
    tokens = synthetic_tokens((config.train_windows + config.val_windows) * config.block_size, seed=1234)
    windows = tokens.view(-1, config.block_size)
    return TensorDataset(windows[:config.train_windows]), windows[config.train_windows:]


def make_loader(dataset, config, rank, world_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed,
                                 drop_last=True)
    loader = DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True)
    return loader, sampler


def build_model(config):
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model_config = GPTConfig(vocab_size=256, block_size=config.block_size, n_layer=2, n_head=2, n_embd=32)
    return JobModel(model_config, config.aux_loss_weight)


def mean_over_ranks(value, device):
    total = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_step(model, optimizer, scaler, micro_batches, config):
    """Forward and backward of every micro-batch, then one optimizer step: (this rank's mean loss, grad norm)."""
    total = torch.zeros((), device=micro_batches[0].device)
    for i, rows in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():  # DDP all-reduces on the last micro-batch only
            with torch.autocast(rows.device.type, dtype=torch.float16, enabled=config.precision == "fp16"):
                _, loss = model(rows, targets=rows)
            scaler.scale(loss / len(micro_batches)).backward()
        total += loss.detach().float() / len(micro_batches)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


@torch.no_grad()
def evaluate(model, val_windows, rank, world_size):
    """Mean loss over the held-out windows; each rank evaluates every world_size-th window."""
    model.eval()
    mine = val_windows[rank::world_size]
    _, loss = model(mine, targets=mine)
    model.train()
    totals = torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64, device=mine.device)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def param_checksum(model):
    """A CRC of the parameters' bytes: equal replicas give equal checksums."""
    crc = 0
    for param in model.parameters():
        crc = zlib.crc32(param.detach().cpu().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def save_checkpoint(path, model, optimizer, step, rank):
    """Rank 0 writes the checkpoint (every replica holds the same weights) atomically; the others wait."""
    if rank == 0:
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_checkpoint(path, model, optimizer):
    state = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def train(config):
    rank, world_size, device = setup()
    out_dir = Path(config.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    checkpoint = out_dir / "checkpoint.pt"
    dataset, val_windows = build_data(config)
    val_windows = val_windows.to(device)
    loader, sampler = make_loader(dataset, config, rank, world_size)
    model = build_model(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    step = 0
    if config.resume and checkpoint.exists():
        step = load_checkpoint(checkpoint, model, optimizer)
        print(f"resumed from {checkpoint.name} at step {step}")
    ddp = DistributedDataParallel(model)
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    history = []
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        micro_batches = []
        for (rows,) in loader:
            micro_batches.append(rows.to(device))
            if len(micro_batches) < config.grad_accum:
                continue
            loss, grad_norm = train_step(ddp, optimizer, scaler, micro_batches, config)
            micro_batches = []
            step += 1
            global_loss = mean_over_ranks(loss, device)
            record = {"step": step, "epoch": epoch, "loss": global_loss, "local_loss": loss.item(),
                      "grad_norm": grad_norm.item(), "params": param_checksum(model)}
            print(f"step {step} | epoch {epoch} | loss {global_loss:.4f} | local loss {loss.item():.4f} | "
                  f"grad norm {grad_norm.item():.4f} | params {record['params']}")
            if step % config.eval_every == 0:
                record["val_loss"] = evaluate(model, val_windows, rank, world_size)
                print(f"step {step} | val loss {record['val_loss']:.4f}")
            if step % config.checkpoint_every == 0:
                save_checkpoint(checkpoint, model, optimizer, step, rank)
            history.append(record)
    save_checkpoint(checkpoint, model, optimizer, step, rank)
    final = build_model(config).to(device)  # what a later evaluation job would do: a fresh model from the file
    load_checkpoint(checkpoint, final, None)
    test_loss = evaluate(final, val_windows, rank, world_size)
    print(f"done after {step} steps | test loss {test_loss:.4f} | params {param_checksum(final)}")
    return {"rank": rank, "history": history, "test_loss": test_loss, "steps": step,
            "state": {name: p.detach().cpu().clone() for name, p in model.named_parameters()}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(JobConfig):
        if f.type == "bool":
            parser.add_argument(f"--{f.name}", action="store_true")
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return JobConfig(**vars(parser.parse_args(argv)))


def main(argv=None):
    config = parse_args(argv)
    print(f"config: {asdict(config)}")
    train(config)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

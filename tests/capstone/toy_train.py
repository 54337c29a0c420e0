"""A small data-parallel training script written the way a learner would port their own: the capstone harness's
test subject. It is right as it stands; --bug makes it wrong in one of the ways the harness must catch.

    torchrun --nproc_per_node=2 tests/capstone/toy_train.py --max_steps 8 --batch_size 4 --out_dir o --log_dir l
"""

import argparse
import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BUGS = ("none", "no_set_epoch", "save_on_every_rank", "save_on_rank_1", "no_sigterm_handler")

parser = argparse.ArgumentParser()
parser.add_argument("--max_steps", type=int, required=True)
parser.add_argument("--batch_size", type=int, required=True, help="rows per rank")
parser.add_argument("--out_dir", required=True)
parser.add_argument("--log_dir", required=True)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--bug", choices=BUGS, default="none")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
Path(args.log_dir).mkdir(parents=True, exist_ok=True)
logging.basicConfig(filename=f"{args.log_dir}/rank_{rank}.log", level=logging.INFO, format="%(message)s")
stop = {"requested": False}
if args.bug != "no_sigterm_handler":
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))

g = torch.Generator().manual_seed(0)
x = torch.randn(48, 8, generator=g)
y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(48, 1, generator=g)
dataset = TensorDataset(x, y)  # 48 rows: 6 steps of 8 rows per epoch
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
ddp = DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
out = Path(args.out_dir)
ckpt_path = out / "checkpoint.pt"
step = 0
if args.resume:
    state = torch.load(ckpt_path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]


def save(step):
    out.mkdir(parents=True, exist_ok=True)
    writer = {"none": rank == 0, "no_set_epoch": rank == 0, "no_sigterm_handler": rank == 0,
              "save_on_every_rank": True, "save_on_rank_1": rank == 1}[args.bug]
    if writer:
        tmp = out / f"checkpoint.pt.tmp{rank}"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, ckpt_path)
    dist.barrier()


per_epoch = len(loader)
epoch, skip = divmod(step, per_epoch)
while step < args.max_steps:
    if args.bug != "no_set_epoch":
        sampler.set_epoch(epoch)
    for i, (xb, yb) in enumerate(loader):
        if i < skip:
            continue
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        flag = torch.tensor([float(stop["requested"])])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        logging.info(f"epoch {epoch} step {step} loss {loss.item():.5f}")
        if step == args.max_steps or flag.item():
            save(step)
            break
    if flag.item():
        logging.info(f"stopped by SIGTERM after step {step}")
        break
    epoch, skip = epoch + 1, 0
dist.barrier()
dist.destroy_process_group()

"""The debugging lab's jobs: versions of train_job.py as a team might have written them, each with one bug.

A job's script is train_job.py with a few lines changed; `script_of(name)` gives the whole text the ranks run,
which the lab writes next to the job's logs (tracebacks point into it). The lab's notebooks never say which
line changed: finding it, from what the job leaves behind, is the exercise.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass, field

from course_lib.debugging import train_job

BASE_SOURCE = inspect.getsource(train_job)


@dataclass(frozen=True)
class Job:
    """patches: (text of train_job.py, the text the job has instead), each found exactly once.
    config: JobConfig fields the job runs with. world_size: the ranks it runs on in the lab."""

    patches: tuple[tuple[str, str], ...]
    config: dict = field(default_factory=dict)
    world_size: int = 2


_LOG_LINE = """            print(f"step {step} | epoch {epoch} | loss {global_loss:.4f} | local loss {loss.item():.4f} | "
                  f"grad norm {grad_norm.item():.4f} | params {record['params']}")
"""

JOBS: dict[str, Job] = {
    # ------------------------------------------------------------------------------ hangs and crashes
    "job_01": Job(patches=((
        """            global_loss = mean_over_ranks(loss, device)
            record = {"step": step, "epoch": epoch, "loss": global_loss, "local_loss": loss.item(),
                      "grad_norm": grad_norm.item(), "params": param_checksum(model)}
""" + _LOG_LINE,
        """            record = {"step": step, "epoch": epoch, "local_loss": loss.item(), "grad_norm": grad_norm.item(),
                      "params": param_checksum(model)}
            if rank == 0:  # the job's log line, written once
                global_loss = record["loss"] = mean_over_ranks(loss, device)
""" + textwrap.indent(_LOG_LINE, "    ")),)),
    "job_02": Job(patches=((
        """            if step % config.eval_every == 0:
                record["val_loss"] = evaluate(model, val_windows, rank, world_size)
                print(f"step {step} | val loss {record['val_loss']:.4f}")""",
        """            if step % config.eval_every == 0 and rank == 0:  # rank 0 reports the validation loss
                record["val_loss"] = evaluate(model, val_windows, rank, world_size)
                print(f"step {step} | val loss {record['val_loss']:.4f}")"""),)),
    "job_03": Job(patches=((
        """    _, loss = model(mine, targets=mine)
    model.train()
    totals = torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64, device=mine.device)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()""",
        """    logits, _ = model(mine)
    model.train()
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), mine[:, 1:], reduction="none")
    per_window = losses.mean(dim=1)  # one loss per window, to find the hardest ones later
    gathered = [torch.empty_like(per_window) for _ in range(world_size)]
    dist.all_gather(gathered, per_window)
    return torch.cat(gathered).mean().item()"""),), config={"val_windows": 11}),
    "job_04": Job(patches=((
        """def make_loader(dataset, config, rank, world_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed,
                                 drop_last=True)
    loader = DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True)
    return loader, sampler""",
        """class ShardSampler(torch.utils.data.Sampler):
    \"\"\"Rank r's windows are r, r + world_size, r + 2 world_size, ..., shuffled each epoch: unlike
    DistributedSampler, no window is read twice and none is left out.\"\"\"

    def __init__(self, num_windows: int, rank: int, world_size: int, seed: int):
        self.windows, self.seed, self.epoch = list(range(rank, num_windows, world_size)), seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter([self.windows[i] for i in order.tolist()])

    def __len__(self) -> int:
        return len(self.windows)


def make_loader(dataset, config, rank, world_size):
    sampler = ShardSampler(len(dataset), rank, world_size, config.seed)
    loader = DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler)
    return loader, sampler"""),), config={"train_windows": 53, "epochs": 1}),
    "job_05": Job(patches=((
        """            global_loss = mean_over_ranks(loss, device)
            record = {"step": step, "epoch": epoch, "loss": global_loss, "local_loss": loss.item(),
                      "grad_norm": grad_norm.item(), "params": param_checksum(model)}
""" + _LOG_LINE + """            if step % config.eval_every == 0:
                record["val_loss"] = evaluate(model, val_windows, rank, world_size)
                print(f"step {step} | val loss {record['val_loss']:.4f}")
""",
        """            record = {"step": step, "epoch": epoch, "local_loss": loss.item(), "grad_norm": grad_norm.item(),
                      "params": param_checksum(model)}
            if rank == 0:  # the log line: the validation loss first, when there is one
                if step % config.eval_every == 0:
                    record["val_loss"] = evaluate(model, val_windows, rank, world_size)
                    print(f"step {step} | val loss {record['val_loss']:.4f}")
                global_loss = record["loss"] = mean_over_ranks(loss, device)
""" + textwrap.indent(_LOG_LINE, "    ") + """            else:
                global_loss = record["loss"] = mean_over_ranks(loss, device)
                if step % config.eval_every == 0:
                    record["val_loss"] = evaluate(model, val_windows, rank, world_size)
"""),)),
    "job_06": Job(patches=((
        """            if step % config.checkpoint_every == 0:
                save_checkpoint(checkpoint, model, optimizer, step, rank)""",
        """            if step % config.checkpoint_every == 0:
                save_checkpoint(checkpoint, ddp, optimizer, step, rank)"""),
        ("""    save_checkpoint(checkpoint, model, optimizer, step, rank)
    final = build_model(config).to(device)""", """    save_checkpoint(checkpoint, ddp, optimizer, step, rank)
    final = build_model(config).to(device)"""),)),
    "job_07": Job(patches=((
        """    save_checkpoint(checkpoint, model, optimizer, step, rank)
    final = build_model(config).to(device)  # what a later evaluation job would do: a fresh model from the file
    load_checkpoint(checkpoint, final, None)""",
        """    final_path = out_dir / "final.pt"
    if rank == 0:
        print("sample:", bytes(model.generate(val_windows[:1, :4], 48)[0].tolist()))  # a look at the model
        save_checkpoint(final_path, model, optimizer, step, rank)
    final = build_model(config).to(device)  # what a later evaluation job would do: a fresh model from the file
    load_checkpoint(final_path, final, None)"""),
        ("""        os.replace(tmp, path)
    dist.barrier()""", """        os.replace(tmp, path)
    if path.name == "checkpoint.pt":
        dist.barrier()"""),)),
    "job_08": Job(patches=((
        """        self.aux_loss_weight = aux_loss_weight
        if aux_loss_weight > 0:
            self.aux_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)""",
        """        self.aux_loss_weight = aux_loss_weight
        self.aux_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)"""),)),
    # ------------------------------------------------------------------------------ silently wrong
    "job_09": Job(patches=((
        """        sampler.set_epoch(epoch)
        micro_batches = []""", """        micro_batches = []"""),), config={"epochs": 3}),
    "job_10": Job(patches=((
        """    if config.resume and checkpoint.exists():
        step = load_checkpoint(checkpoint, model, optimizer)
        print(f"resumed from {checkpoint.name} at step {step}")
    ddp = DistributedDataParallel(model)""",
        """    ddp = DistributedDataParallel(model)
    if config.resume and checkpoint.exists() and rank == 0:  # DDP hands rank 0's weights to the others
        step = load_checkpoint(checkpoint, model, optimizer)
        print(f"resumed from {checkpoint.name} at step {step}")"""),), config={"resume": True}),
    "job_11": Job(patches=((
        """        with nullcontext() if last else model.no_sync():  # DDP all-reduces on the last micro-batch only
            with torch.autocast(rows.device.type, dtype=torch.float16, enabled=config.precision == "fp16"):
                _, loss = model(rows, targets=rows)
            scaler.scale(loss / len(micro_batches)).backward()""",
        """        with torch.autocast(rows.device.type, dtype=torch.float16, enabled=config.precision == "fp16"):
            _, loss = model(rows, targets=rows)
        scaler.scale(loss / len(micro_batches)).backward()"""),
        ("""        last = i == len(micro_batches) - 1
""", ""),), config={"grad_accum": 4, "micro_batch": 1}),
    "job_12": Job(patches=((
        """            scaler.scale(loss / len(micro_batches)).backward()""",
        """            scaler.scale(loss / (len(micro_batches) * dist.get_world_size())).backward()  # the mean over all rows"""),)),
    "job_13": Job(patches=((
        """            scaler.scale(loss / len(micro_batches)).backward()""",
        """            scaler.scale(loss).backward()"""),), config={"grad_accum": 4, "micro_batch": 1}),
}


def script_of(name: str) -> str:
    """The whole text of job `name`'s script (train_job.py with the job's changes)."""
    if name not in JOBS:
        raise KeyError(f"no job named {name!r}: the lab's jobs are {', '.join(JOBS)}")
    source = BASE_SOURCE
    for old, new in JOBS[name].patches:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"{name}: a change expects its text once in train_job.py, found it {count} times:\n{old}")
        source = source.replace(old, new)
    return source

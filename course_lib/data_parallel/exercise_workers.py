"""Rank workers that grade the data-parallel exercises: the learner's function on every rank, next to DDP.

The check_* workers run a learner's function (made importable by course_lib.runtime.spawn.spawnable) on
every rank next to torch's DistributedDataParallel; gradient_averaging_reference and
train_steps_one_process compute, in one process and with course_lib's code, what the ranks must match.

    ranks = launch(check_gradient_averaging, 3, args=(spawnable(data_parallel_backward),))
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.model import GPT
from course_lib.core.optim import make_scheduler
from course_lib.core.steps import train_step as reference_train_step
from course_lib.parity import global_batches, gradients, local_rows, seeded_gpt


def _tiny_model(seed: int, frozen: tuple[str, ...] = ()) -> GPT:
    model = seeded_gpt(seed, "tiny")
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


FROZEN = ("blocks.0.attn.q_proj.weight", "norm_f.weight")
"""Parameters frozen in the second case of the gradient check: their .grad stays None."""


def check_gradient_averaging(backward_fn, *, rows_per_rank: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """Worker: each rank calls backward_fn(model, its rows) on identical replicas; returns what it left in .grad.

    Two cases: every parameter trainable ("all"), and FROZEN parameters without gradients ("frozen").
    A case that raises is reported as {"error": ...} so the other case is still checked.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"rank": rank, "world_size": world_size}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _tiny_model(seed, frozen)
        rows = local_rows(global_batches(1, rows_per_rank * world_size, seq_len, seed)[0], rank, world_size)
        try:
            loss = backward_fn(model, rows)
        except Exception as err:  # noqa: BLE001 (reported to the caller, which fails the check)
            results[case] = {"error": f"{type(err).__name__}: {err}"}
            continue
        with torch.no_grad():
            local_loss = model(rows, targets=rows)[1].item()
        results[case] = {"error": None, "grads": gradients(model), "local_loss": local_loss,
                         "returned_loss": float(loss) if isinstance(loss, (torch.Tensor, float, int)) else loss}
    return results


def gradient_averaging_reference(world_size: int, *, rows_per_rank: int = 2, seq_len: int = 16,
                                 seed: int = 0) -> dict:
    """One process, the whole global batch: the gradients every rank must hold after averaging."""
    reference = {}
    for case, frozen in (("all", ()), ("frozen", FROZEN)):
        model = _tiny_model(seed, frozen)
        batch = global_batches(1, rows_per_rank * world_size, seq_len, seed)[0]
        model(batch, targets=batch)[1].backward()
        reference[case] = gradients(model)
    return reference


def _step_setup(seed: int, lr: float, steps: int):
    model = _tiny_model(seed)
    # SGD, not AdamW: its update is proportional to the gradient, so a wrong scale shows in the weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = make_scheduler(optimizer, max_lr=lr, min_lr=lr / 10, warmup_steps=1, max_steps=steps)
    return model, optimizer, scheduler


def check_train_step(train_step_fn, *, steps: int = 3, grad_accum_steps: int = 3, micro_batch: int = 1,
                     seq_len: int = 16, lr: float = 0.5, seed: int = 0) -> dict:
    """Worker: `steps` calls of train_step_fn on a DDP model, passing no_sync=ddp.no_sync.

    Returns this rank's records (what train_step_fn returned), final weights, and the all-reduces DDP
    launched in each step next to the number one synchronised backward launches.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = _step_setup(seed, lr, steps)
    ddp = DistributedDataParallel(model)
    launched = []

    def counting_allreduce(state, bucket):
        launched.append(bucket.index())
        return allreduce_hook(None, bucket)  # DDP's own averaging all-reduce, counted

    ddp.register_comm_hook(None, counting_allreduce)
    batches = global_batches(steps * grad_accum_steps, micro_batch * world_size, seq_len, seed)
    records, allreduces_per_step = [], []
    for step in range(steps):
        micro_batches = [local_rows(b, rank, world_size) for b in batches[step * grad_accum_steps:][:grad_accum_steps]]
        before = len(launched)
        records.append(train_step_fn(ddp, micro_batches, optimizer, scheduler, no_sync=ddp.no_sync))
        allreduces_per_step.append(len(launched) - before)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    # One ordinary synchronised backward: how many all-reduces "communicate once" means for this model.
    before = len(launched)
    ddp(micro_batches[0], targets=micro_batches[0])[1].backward()
    return {"rank": rank, "world_size": world_size, "records": records, "params": params,
            "allreduces_per_step": allreduces_per_step, "allreduces_per_backward": len(launched) - before}


def train_steps_one_process(train_step_fn=None, world_size: int = 2, *, steps: int = 3, grad_accum_steps: int = 3,
                            micro_batch: int = 1, seq_len: int = 16, lr: float = 0.5, seed: int = 0,
                            grad_clip: float | None = None) -> dict:
    """The same steps in one process, every rank's rows in each micro-batch (default: course_lib's train_step).

    With world_size ranks of `micro_batch` rows each, this is what check_train_step's ranks must match.
    """
    train_step_fn = train_step_fn or reference_train_step
    model, optimizer, scheduler = _step_setup(seed, lr, steps)
    batches = global_batches(steps * grad_accum_steps, micro_batch * world_size, seq_len, seed)
    records = [train_step_fn(model, batches[step * grad_accum_steps:][:grad_accum_steps], optimizer, scheduler,
                             grad_clip=grad_clip)
               for step in range(steps)]
    return {"records": records, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}

"""Rank workers for FSDP and ZeroRedundancyOptimizer: parity with one process, bytes per rank, checkpoints.

Each worker runs on every rank of a course_lib.runtime.launch job (or torchrun) and returns plain tensors and numbers;
the `*_one_process` functions compute, in one process, what the ranks must match:

    from course_lib.runtime.launch import launch
    from course_lib.sharding import fsdp_workers as fw
    ranks = launch(fw.train_fsdp, 2, kwargs=dict(strategy="FULL_SHARD", steps=3), threads_per_rank=1)
    reference = fw.train_one_process(world_size=2, steps=3)       # same global batches, one process
    ranks = launch(run_each, 2, args=([(fw.train_fsdp, {}), (fw.fsdp_memory, {})],))   # one start-up
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from course_lib.checkpoint.fsdp import (
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
)
from course_lib.core.model import GPTConfig
from course_lib.core.optim import configure_optimizer, param_groups
from course_lib.core.steps import train_step
from course_lib.sharding.fsdp import (
    build_mesh,
    expected_fsdp_model_states,
    local_shapes,
    mixed_precision_policy,
    apply_fsdp,
)
from course_lib.sharding.model_states import live_bytes, measure_model_states
from course_lib.tensor_parallel.dtensor import full_copy
from course_lib.parity import global_batches, local_rows, seeded_gpt, train_whole_batches

PADDED = dict(vocab_size=251, n_layer=2, n_head=3, n_embd=36, ffn_hidden=50, block_size=32)
"""A model whose dims 0 (251, 36, 50) do not divide by 2 or 4: FSDP must pad them."""


# ------------------------------------------------------------------ training parity
def _optimizer(model, name: str, lr: float):
    # SGD by default: its update is proportional to the gradient, so an error in the averaged gradient shows,
    # while AdamW divides by sqrt(v) and turns the last-bit differences of a near-zero gradient (summed in
    # another order) into visible ones.
    if name not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")
    return torch.optim.SGD(model.parameters(), lr=lr) if name == "sgd" else configure_optimizer(model, lr)


def train_fsdp(strategy: str = "FULL_SHARD", *, steps: int = 3, rows_per_rank: int = 2, seq_len: int = 32,
               preset: str = "tiny", optimizer: str = "sgd", lr: float = 0.5, seed: int = 0, grad_clip: float = 1.0,
               precision: str = "fp32", ranks_per_node: int | None = None, apply_fn=None) -> dict:
    """Worker: `steps` optimizer steps of a sharded model, each rank on its own rows of the same global batches.

    apply_fn(model, mesh) replaces apply_fsdp (to check a wrapping function). Returns the full parameters
    after training, this rank's losses and the shapes of its shards.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = seeded_gpt(seed, preset)
    if apply_fn is None:
        apply_fsdp(model, strategy=strategy, mp_policy=mixed_precision_policy(precision),
                    ranks_per_node=ranks_per_node)
    else:
        apply_fn(model, build_mesh(strategy))
    optimizer = _optimizer(model, optimizer, lr)
    losses = []
    for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
        rows = local_rows(batch, rank, world_size)
        losses.append(train_step(model, [rows], optimizer, grad_clip=grad_clip)["loss"])
    return {"rank": rank, "strategy": strategy, "losses": losses, "shapes": local_shapes(model),
            "placements": {n: f"{type(p).__name__} {getattr(p, 'placements', '')}" for n, p in model.named_parameters()},
            "params": {n: full_copy(p) for n, p in model.named_parameters()},
            "fsdp_modules": sorted(n or "<root>" for n, m in model.named_modules() if hasattr(m, "reshard"))}


def train_one_process(world_size: int = 2, *, steps: int = 3, rows_per_rank: int = 2, seq_len: int = 32,
                      preset: str = "tiny", optimizer: str = "sgd", lr: float = 0.5, seed: int = 0,
                      grad_clip: float = 1.0) -> dict:
    """The reference of train_fsdp / zero_redundancy_vs_ddp: one process, every rank's rows in each batch."""
    model = seeded_gpt(seed, preset)
    return train_whole_batches(model, _optimizer(model, optimizer, lr),
                               global_batches(steps, rows_per_rank * world_size, seq_len, seed), grad_clip=grad_clip)


# ------------------------------------------------------------------ bytes per rank
def fsdp_memory(strategy: str = "FULL_SHARD", *, config: dict | None = None, preset: str = "tiny", seed: int = 0,
                ranks_per_node: int | None = None, rows_per_rank: int = 2, seq_len: int = 16) -> dict:
    """Worker: model states this rank holds after one AdamW step (gradients kept), measured and predicted.

    Also the parameter bytes held between forward and backward: shards only under FULL_SHARD, the gathered
    (unsharded) parameters under SHARD_GRAD_OP, whose forward keeps them for the backward.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = seeded_gpt(seed, preset, GPTConfig(**config) if config else None)
    if strategy == "DDP":  # torch DDP, for comparison
        train_model = DistributedDataParallel(model)
    else:
        train_model = apply_fsdp(model, strategy=strategy, ranks_per_node=ranks_per_node)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, model.config.vocab_size, (rows_per_rank, seq_len), generator=torch.Generator().manual_seed(rank))
    held = {}

    def forward_backward(micro_batches):
        _, loss = train_model(micro_batches[0], targets=micro_batches[0])
        held["between"] = live_bytes(model.parameters())  # what the modules hold right now, gathered or not
        loss.backward()
        return loss.detach()

    # one step, its gradients kept: the states below count them
    train_step(train_model, [idx], optimizer, forward_backward=forward_backward, grad_norm=False, zero_grad=False)
    between = held["between"]
    expected = None
    if strategy != "DDP":
        expected = expected_fsdp_model_states(model, world_size, rank, strategy=strategy, ranks_per_node=ranks_per_node)
    return {"rank": rank, "strategy": strategy, "measured": measure_model_states(model, optimizer), "expected": expected,
            "between_forward_and_backward": between, "n_params": model.num_params()}


# ------------------------------------------------------------------ ZeroRedundancyOptimizer
def zero_redundancy_vs_ddp(*, steps: int = 3, rows_per_rank: int = 2, seq_len: int = 32, preset: str = "tiny",
                           lr: float = 1e-2, seed: int = 0, grad_clip: float = 1.0) -> dict:
    """Worker: DDP + AdamW, then DDP + ZeroRedundancyOptimizer(AdamW) (ZeRO-1), on the same batches.

    ZeroRedundancyOptimizer gives each rank whole parameters (greedily, largest first) and keeps AdamW state
    for those only; after its local step each rank broadcasts the parameters it owns.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank}
    for variant in ("adamw", "zero1"):
        model = seeded_gpt(seed, preset)
        ddp = DistributedDataParallel(model)
        if variant == "adamw":
            optimizer = configure_optimizer(model, lr)
        else:
            optimizer = ZeroRedundancyOptimizer(param_groups(model, 0.1), optimizer_class=torch.optim.AdamW,
                                                lr=lr, betas=(0.9, 0.95))
        for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
            train_step(ddp, [local_rows(batch, rank, world_size)], optimizer, grad_clip=grad_clip)
        local = optimizer.optim if variant == "zero1" else optimizer  # the AdamW that holds this rank's state
        names = {id(p): n for n, p in model.named_parameters()}
        states = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        out[variant] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "optimizer_state_bytes": live_bytes(states),
                        "owned": [names[id(p)] for g in local.param_groups for p in g["params"]]}
    return out


# ------------------------------------------------------------------ checkpoints
def fsdp_checkpoints(directory: str, *, strategy: str = "FULL_SHARD", steps: int = 2, rows_per_rank: int = 2,
                     seq_len: int = 32, preset: str = "tiny", lr: float = 1e-2, seed: int = 0) -> dict:
    """Worker: train, save a full checkpoint (rank 0's file) and a DCP one, then resume from each into fresh
    sharded models. Returns logits of a fixed batch, and parameters after one more step: trained, resumed
    from the full file, resumed from DCP (all three must be equal)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory = Path(directory)
    batches = global_batches(steps + 1, rows_per_rank * world_size, seq_len, seed)
    mine = [local_rows(b, rank, world_size) for b in batches]

    def fresh():
        model = apply_fsdp(seeded_gpt(seed + 7, preset), strategy=strategy)  # other weights: loading must matter
        return model, configure_optimizer(model, lr)

    model = apply_fsdp(seeded_gpt(seed, preset), strategy=strategy)
    optimizer = configure_optimizer(model, lr)
    for rows in mine[:steps]:
        train_step(model, [rows], optimizer, grad_clip=1.0)
    full_path = save_full_checkpoint(directory / "full", step=steps, model=model, optimizer=optimizer)
    save_sharded_checkpoint(directory / "dcp", model=model, optimizer=optimizer)
    dist.barrier()  # rank 0's file is complete before anyone reads it
    probe = batches[0][:2]
    with torch.no_grad():
        logits = full_copy(model(probe)[0])
    after = {}
    for source in ("trained", "full", "dcp"):
        if source == "full":
            model, optimizer = fresh()
            load_full_checkpoint(directory / "full" / "latest.pt", model=model, optimizer=optimizer)
        elif source == "dcp":
            model, optimizer = fresh()
            load_sharded_checkpoint(directory / "dcp", model=model, optimizer=optimizer)
        train_step(model, [mine[steps]], optimizer, grad_clip=1.0)
        after[source] = {n: full_copy(p) for n, p in model.named_parameters()}
    return {"rank": rank, "logits": logits, "probe": probe, "full_path": str(full_path) if full_path else None,
            "after_one_more_step": after, "files": sorted(p.name for p in (directory / "dcp").iterdir())}


def check_full_checkpoint(save_fn, directory: str, *, strategy: str = "FULL_SHARD", steps: int = 2,
                          rows_per_rank: int = 2, seq_len: int = 32, preset: str = "tiny", seed: int = 0) -> dict:
    """Worker: train a sharded model, then save_fn(model, <directory>/full.pt, steps) on every rank (a learner's
    full-checkpoint function) and course_lib's DCP save to <directory>/dcp.

    On ranks other than 0, torch.save records that it was called and raises PermissionError (so a rank that
    should not write cannot disturb rank 0's file). An exception from save_fn is reported, not raised.
    Returns the logits of the sharded model on a probe batch, to compare with a model loaded from either
    checkpoint.
    """
    from unittest import mock

    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory = Path(directory)
    model = apply_fsdp(seeded_gpt(seed, preset), strategy=strategy)
    optimizer = configure_optimizer(model, 1e-2)
    for batch in global_batches(steps, rows_per_rank * world_size, seq_len, seed):
        train_step(model, [local_rows(batch, rank, world_size)], optimizer, grad_clip=1.0)
    saves, error = [], None

    def refuse(obj, f, *args, **kwargs):
        saves.append(str(f))
        raise PermissionError(f"rank {rank} must not write the checkpoint: only rank 0 writes")

    try:
        with mock.patch.object(torch, "save", refuse) if rank else nullcontext():
            save_fn(model, directory / "full.pt", steps)
    except Exception as err:  # noqa: BLE001 (reported to the caller, which fails the check)
        error = f"{type(err).__name__}: {err}"
    dist.barrier()  # rank 0 has written before anyone reads, whatever save_fn did
    save_sharded_checkpoint(directory / "dcp", model=model)
    probe = global_batches(1, 2, seq_len, seed + 5)[0]
    with torch.no_grad():
        logits = full_copy(model(probe)[0])
    return {"rank": rank, "error": error, "torch_save_calls": saves, "probe": probe, "logits": logits}


def resharded_training(save_fn, load_fn, directory: str, *, phase: str, steps: int = 2, global_batch: int = 4,
                       seq_len: int = 16, lr: float = 1e-2, seed: int = 0) -> dict:
    """Worker: a sharded checkpoint written on some ranks and resumed on another number of them.

    phase "save": train `steps` AdamW steps of a FULL_SHARD model whose dims do not divide by the world size
    (PADDED), call save_fn(model, optimizer, directory, steps) on every rank, then take one more step.
    phase "load": build the model and optimizer afresh with other weights, call
    step = load_fn(model, optimizer, directory) on every rank, then take the same one more step.
    Both return the full parameters and AdamW states (every rank gathers them) right after the save or the load,
    the step, and the parameters after the one more step, to compare between the two world sizes.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if phase not in ("save", "load"):
        raise ValueError(f"phase must be 'save' or 'load', got {phase!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = global_batches(steps + 1, global_batch, seq_len, seed, vocab_size=PADDED["vocab_size"])
    config = GPTConfig(**PADDED)
    model = apply_fsdp(seeded_gpt(seed if phase == "save" else seed + 7, config=config))
    optimizer = configure_optimizer(model, lr)
    step = None
    if phase == "save":
        for batch in batches[:steps]:
            train_step(model, [local_rows(batch, rank, world_size)], optimizer, grad_clip=1.0)
        save_fn(model, optimizer, directory, steps)
        dist.barrier()
        step = steps
    else:
        step = load_fn(model, optimizer, directory)
    full = StateDictOptions(full_state_dict=True)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=full)["state"]
    states = {name: {key: full_copy(value).clone() if torch.is_tensor(value) else value for key, value in s.items()}
              for name, s in optimizer_state.items()}
    params = {n: full_copy(p) for n, p in model.named_parameters()}
    train_step(model, [local_rows(batches[steps], rank, world_size)], optimizer, grad_clip=1.0)
    return {"rank": rank, "world_size": world_size, "step": step, "params": params, "optimizer_states": states,
            "after_one_more_step": {n: full_copy(p) for n, p in model.named_parameters()}}

"""Checkpoints of an FSDP model, two ways: one full file gathered on rank 0, or torch.distributed.checkpoint shards.

Under FSDP no rank holds the whole model, so `model.state_dict()` returns DTensor shards. Two ways out:

1. Full state dict (what course_lib.train writes): every rank takes part in gathering the full tensors
   (`get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`: rank 0 receives them on the CPU,
   the others get nothing), and rank 0 writes an ordinary course_lib checkpoint, atomically. The optimizer
   state is stored in torch's plain format (integer parameter ids), so the file is the same a single
   process writes: scripts/evaluate.py reads it and any strategy resumes from it. Rank 0 must hold the whole
   model in CPU memory: fine up to a few billion parameters.
2. Sharded (torch.distributed.checkpoint, DCP): every rank writes its own shards in parallel
   (`__<rank>_0.distcp`) and rank 0 a `.metadata` index, written last. Nothing is gathered, so it scales to
   any size, and it loads into any number of ranks, or into one process without a process group:

    python scripts/evaluate.py runs/fsdp/dcp            # reads model_config.json next to the shards
    python -m torch.distributed.checkpoint.format_utils dcp_to_torch runs/fsdp/dcp model.pt   # one file
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from course_lib.checkpoint.atomic import atomic_write, load_checkpoint, save_training_checkpoint, set_rng_state

FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
MODEL_CONFIG = "model_config.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def gather_full_state_dict(model: nn.Module) -> dict:
    """The full model state dict (plain CPU tensors) on rank 0, {} elsewhere. Every rank must call it."""
    return get_model_state_dict(model, options=FULL_ON_RANK0)


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}  # the tied tensor once, under its first name
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def gather_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state on rank 0 in torch's plain format ({} elsewhere). Every rank must call it.

    torch's distributed API keys the state by parameter name; a plain optimizer.state_dict() numbers the
    parameters 0, 1, ... in param_groups order. Converting makes the two interchangeable.
    """
    by_name = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK0)
    if not by_name:
        return {}
    index, groups, state = 0, [], {}
    for group, names in zip(by_name["param_groups"], _parameter_names(model, optimizer)):
        ids = list(range(index, index + len(names)))
        index += len(names)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state.update({i: by_name["state"][n] for i, n in zip(ids, names) if n in by_name["state"]})
    return {"state": state, "param_groups": groups}


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer, plain: dict) -> dict:
    """torch's plain optimizer state dict (integer ids) -> the name-keyed form set_optimizer_state_dict takes."""
    groups, state = [], {}
    for group, names in zip(plain["param_groups"], _parameter_names(model, optimizer)):
        if len(group["params"]) != len(names):
            raise ValueError(f"the checkpoint's optimizer group has {len(group['params'])} parameters, "
                             f"this optimizer's has {len(names)}: not the same model or parameter groups")
        groups.append({**group, "params": names})
        state.update({n: plain["state"][i] for i, n in zip(group["params"], names) if i in plain["state"]})
    return {"state": state, "param_groups": groups}


class _Gathered:
    """Looks like a module/optimizer to course_lib.checkpoint.atomic: state_dict() returns what was gathered."""

    def __init__(self, state: dict, config=None):
        self._state, self.config = state, config

    def state_dict(self) -> dict:
        return self._state


def save_full_checkpoint(directory, *, step: int, model: nn.Module, optimizer=None, keep_last: int | None = None,
                         **state) -> Path | None:
    """Gather on rank 0 and write directory/ckpt_step{step}.pt (+ latest.pt) atomically, as a single process
    would. Every rank must call it; returns the path on rank 0, None elsewhere. `state`: scheduler, scaler,
    data_state, extra (as course_lib.checkpoint.atomic.save_training_checkpoint)."""
    model_state = gather_full_state_dict(model)
    optimizer_state = gather_full_optimizer_state(model, optimizer) if optimizer is not None else None
    if _rank() != 0:
        return None
    return save_training_checkpoint(
        directory, step=step, keep_last=keep_last, model=_Gathered(model_state, getattr(model, "config", None)),
        optimizer=_Gathered(optimizer_state) if optimizer is not None else None, **state)


def load_full_checkpoint(path, *, model: nn.Module, optimizer=None, scheduler=None, scaler=None,
                         restore_rng: bool = True) -> dict:
    """Load a full checkpoint file (from any strategy) into a sharded model and its optimizer, on every rank.

    Each rank reads the file and keeps its own shards. Returns the checkpoint dict (step, data_state, ...).
    """
    ckpt = load_checkpoint(path, scheduler=scheduler, scaler=scaler, restore_rng=False)
    set_model_state_dict(model, ckpt["model"], options=StateDictOptions(full_state_dict=True))
    if optimizer is not None:
        if ckpt.get("optimizer") is None:
            raise ValueError(f"checkpoint {path} has no optimizer state, but an optimizer was passed to load it into")
        set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, ckpt["optimizer"]),
                                 options=StateDictOptions(full_state_dict=True))
    if restore_rng:
        set_rng_state(ckpt["rng"])
    return ckpt


def save_sharded_checkpoint(directory, *, model: nn.Module, optimizer=None) -> Path:
    """torch.distributed.checkpoint: every rank writes its shards of {"model": ..., "optimizer": ...} to
    `directory`; rank 0 adds model_config.json. Every rank must call it."""
    directory = Path(directory)
    state = {"model": get_model_state_dict(model)}  # DTensor shards: nothing is gathered
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(directory))
    config = getattr(model, "config", None)
    if _rank() == 0 and hasattr(config, "to_dict"):
        atomic_write(directory / MODEL_CONFIG, lambda f: f.write(json.dumps(config.to_dict(), indent=1).encode()))
    if dist.is_initialized():
        dist.barrier()  # nobody reads the directory before model_config.json is there
    return directory


def load_sharded_checkpoint(directory, *, model: nn.Module, optimizer=None) -> nn.Module:
    """Load a DCP directory into `model`: sharded (on its ranks, any number of them) or plain, in one process
    with or without a process group. Returns the model."""
    directory = Path(directory)
    if not (directory / ".metadata").exists():
        raise FileNotFoundError(f"{directory} holds no torch.distributed.checkpoint (.metadata is missing)")
    sharded = hasattr(model, "reshard")  # an FSDPModule: only its ranks together hold the tensors
    if sharded:
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=str(directory))
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return model
    if optimizer is not None:
        raise ValueError("load an optimizer state from DCP through the sharded model (or save a full checkpoint)")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # torch warns that it will load "in a single process": what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())  # fills the tensors in place
    model.load_state_dict(state["model"])
    return model

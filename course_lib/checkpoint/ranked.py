"""Ranked checkpoints: every rank writes its own shard, rank 0 writes the manifest last.

    directory/
      rank_00000-<save>.pt ... rank_0000{N-1}-<save>.pt   one shard per rank: a slice of the flattened parameters,
                                                          RNG and extra; <save> is new at every save
      manifest.json                                       written last: world size, step, parameter names/shapes,
                                                          the shard files with their sizes and sha256

The parameters are flattened in a fixed order, padded with zeros to a multiple of the world size and cut into
equal slices (as ZeRO-3 and FSDP do), so N ranks write in parallel and none writes the whole model. A checkpoint
without manifest.json is incomplete (a rank died while saving) and is refused. Saving again into the same
directory writes new shard files beside the old ones; the new manifest replaces the old one atomically (the
commit point), and only then are the old shards deleted: a save that dies half-way leaves the previous
checkpoint whole and loadable. Loading with a different world
size is refused unless `reshard=True`: the parameters are then reassembled and re-split, and per-rank state
(RNG, data position) is dropped because it has no meaning for the new ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.checkpoint.atomic import atomic_write, get_rng_state, set_rng_state, unwrap_model
from course_lib.data_parallel.collectives import shard_numel

FORMAT = "course_lib.checkpoint.ranked"
MANIFEST = "manifest.json"


def shard_file(rank: int, save_id: str | None = None) -> str:
    return f"rank_{rank:05d}.pt" if save_id is None else f"rank_{rank:05d}-{save_id}.pt"


def _flat_parameters(model: nn.Module) -> tuple[torch.Tensor, list[tuple[str, list[int]]]]:
    params = list(unwrap_model(model).named_parameters())  # tied weights appear once
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for _, p in params])
    return flat, [(name, list(p.shape)) for name, p in params]


def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, padded_numel): rank's slice of a flat vector padded to a multiple of world_size."""
    shard = shard_numel(numel, world_size)
    return rank * shard, (rank + 1) * shard, shard * world_size


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_ranked_checkpoint(directory, model: nn.Module, *, step: int, extra: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the manifest path (complete once this returns on rank 0)."""
    directory = Path(directory)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / MANIFEST
    save_id = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(save_id, src=0)  # one name for this save's shards, beside any earlier checkpoint's
    files = [shard_file(r, save_id[0]) for r in range(world_size)]
    flat, params = _flat_parameters(model)
    start, end, padded = shard_bounds(flat.numel(), rank, world_size)
    shard = torch.nn.functional.pad(flat, (0, padded - flat.numel()))[start:end].clone()
    payload = {"format": FORMAT, "rank": rank, "world_size": world_size, "step": step, "shard": shard,
               "rng": get_rng_state(), "extra": extra or {}}
    atomic_write(directory / files[rank], lambda f: torch.save(payload, f))
    dist.barrier()  # every shard is on disk before the manifest says the checkpoint exists
    if rank == 0:
        config = getattr(unwrap_model(model), "config", None)
        manifest = {"format": FORMAT, "step": step, "world_size": world_size, "numel": flat.numel(),
                    "padded_numel": padded, "params": params,
                    "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
                    "shards": [{"rank": r, "file": files[r], "bytes": (directory / files[r]).stat().st_size,
                                "sha256": _sha256(directory / files[r])} for r in range(world_size)]}
        atomic_write(manifest_path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))  # the commit point
        for old in directory.glob("rank_*.pt"):  # an earlier checkpoint's shards, no longer listed anywhere
            if old.name not in files:
                old.unlink()
    dist.barrier()
    return manifest_path


def read_manifest(directory) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        shards = sorted(p.name for p in directory.glob("rank_*.pt")) if directory.is_dir() else []
        raise FileNotFoundError(
            f"{directory} is not a complete ranked checkpoint: no {MANIFEST} (rank 0 writes it last)"
            + (f"; shard files present: {shards} — the save was interrupted" if shards else ""))
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a ranked-checkpoint manifest (format {manifest.get('format')!r})")
    return manifest


def load_full_parameters(directory, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Reassemble every parameter from all shards (no process group needed): ({name: tensor}, manifest)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    pieces = []
    for entry in manifest["shards"]:
        path = directory / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in the manifest but missing")
        if verify and (path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]):
            raise ValueError(f"{path} does not match the manifest (size or sha256): the shard was changed or damaged")
        pieces.append(torch.load(path, map_location="cpu", weights_only=True)["shard"])
    flat = torch.cat(pieces)[: manifest["numel"]]
    params, offset = {}, 0
    for name, shape in manifest["params"]:
        numel = math.prod(shape)
        params[name] = flat[offset:offset + numel].view(shape)
        offset += numel
    return params, manifest


def load_ranked_checkpoint(directory, model: nn.Module, *, reshard: bool = False, restore_rng: bool = True) -> dict:
    """Load into `model` on every rank. Returns {'step', 'extra' (this rank's, or {} after a reshard), ...}."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if manifest["world_size"] != world_size and not reshard:
        raise ValueError(
            f"{directory} was written by {manifest['world_size']} ranks but is being loaded by {world_size}: "
            "per-rank state (RNG, data position) cannot be mapped. Load with the same world size, or pass "
            "reshard=True to reassemble the parameters and drop per-rank state.")
    params, _ = load_full_parameters(directory)
    model = unwrap_model(model)
    current = dict(model.named_parameters())
    if set(current) != set(params):
        raise ValueError(f"{directory} does not fit the model: missing {sorted(set(current) - set(params))}, "
                         f"unexpected {sorted(set(params) - set(current))}")
    with torch.no_grad():
        for name, tensor in params.items():
            if current[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} vs model {tuple(current[name].shape)}")
            current[name].copy_(tensor)
    result = {"step": manifest["step"], "world_size": manifest["world_size"], "extra": {}, "resharded": False}
    if manifest["world_size"] == world_size:
        own = torch.load(directory / manifest["shards"][rank]["file"], map_location="cpu", weights_only=True)
        result["extra"] = own["extra"]
        if restore_rng:
            set_rng_state(own["rng"])
    else:
        result["resharded"] = True
    return result

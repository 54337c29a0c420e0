"""Rank workers for ranked checkpoints: save on N ranks, load on M (resharded), refuse a mismatch."""

from __future__ import annotations

import logging

from course_lib.checkpoint import ranked
from course_lib.checkpoint.ranked import load_ranked_checkpoint, read_manifest, save_ranked_checkpoint
from course_lib.core.model import GPTConfig
from course_lib.runtime.env import get_dist_info
from course_lib.testing import flat_parameters, seeded_gpt

log = logging.getLogger("course")  # course_lib.runtime.launch sends it to logs/rank_<r>/train.log


def save_ranked(directory: str, preset: str = "tiny", seed: int = 0, step: int = 7) -> dict:
    info = get_dist_info()
    model = seeded_gpt(seed, preset)
    save_ranked_checkpoint(directory, model, step=step, extra={"data_position": 100 + info.rank})
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def load_ranked(directory: str, preset: str = "tiny", reshard: bool = False) -> dict:
    model = seeded_gpt(1234, preset)
    result = load_ranked_checkpoint(directory, model, reshard=reshard)
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def load_ranked_here(directory: str, reshard: bool = False) -> dict:
    """Load a ranked checkpoint on this job's ranks (model shape from its manifest); raises if refused."""
    manifest = read_manifest(directory)
    model = seeded_gpt(1234, config=GPTConfig(**manifest["model_config"]))
    result = load_ranked_checkpoint(directory, model, reshard=reshard)
    return {"rank": get_dist_info().rank, "step": result["step"], "saved_by": result["world_size"],
            "resharded": result["resharded"], "extra": result["extra"], "params": flat_parameters(model)}


def refuse_then_reshard(directory: str) -> dict:
    """Both answers to a world-size change in one job: the refusal's message, then a resharded load."""
    try:
        load_ranked_here(directory, reshard=False)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"refused": refused, **load_ranked_here(directory, reshard=True)}


def save_twice_dying(directory: str, die_at: str, dying_rank: int = 0) -> None:
    """Save step 1, then save step 2 into the same directory, with `dying_rank` SIGKILLed in the middle of it:
    die_at "shard" (while writing its shard) or "manifest" (with every shard written, just before the commit).

    What a crash test needs: whatever moment the save dies at, the step-1 checkpoint must stay loadable.
    """
    import os
    import signal
    from unittest import mock


    if die_at not in ("shard", "manifest"):
        raise ValueError(f"die_at must be 'shard' or 'manifest', got {die_at!r}")
    rank = get_dist_info().rank
    save_ranked_checkpoint(directory, seeded_gpt(0, "tiny"), step=1)
    real_write = ranked.atomic_write

    def dying_write(path, write):
        is_manifest = str(path).endswith(ranked.MANIFEST)
        if rank == dying_rank and is_manifest == (die_at == "manifest"):
            if die_at == "shard":
                with open(f"{path}.tmp-dying", "wb") as f:  # half a file on disk, as a crash leaves it
                    f.write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(path, write)

    with mock.patch.object(ranked, "atomic_write", dying_write):
        save_ranked_checkpoint(directory, seeded_gpt(1, "tiny"), step=2)

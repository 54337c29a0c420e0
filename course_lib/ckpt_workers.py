"""Rank workers for ranked checkpoints (Session C): save on N ranks, load on M."""

from __future__ import annotations

import torch

from course_lib.dist import get_dist_info
from course_lib.model import GPT, GPTConfig
from course_lib.ranked_checkpoint import load_ranked_checkpoint, save_ranked_checkpoint


def save_ranked(directory: str, preset: str = "tiny", seed: int = 0, step: int = 7) -> dict:
    info = get_dist_info()
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset(preset))
    save_ranked_checkpoint(directory, model, step=step, extra={"data_position": 100 + info.rank})
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def load_ranked(directory: str, preset: str = "tiny", reshard: bool = False) -> dict:
    torch.manual_seed(1234)  # different weights: the load must overwrite every one
    model = GPT(GPTConfig.from_preset(preset))
    result = load_ranked_checkpoint(directory, model, reshard=reshard)
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result

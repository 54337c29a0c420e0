"""Which samples each rank sees: the arithmetic of torch's DistributedSampler, written out.

    shard_indices(10, rank=1, world_size=4)  ->  [1, 5, 9, 3]   (padded so every rank gets 3)

Every rank draws the same permutation (same seed + epoch), pads it by repeating it from its start until its
length divides evenly, as many times as needed when there are fewer samples than ranks (or drops the tail with
drop_last), then takes every world_size-th index starting at its rank.
Equal shard sizes matter: a rank with one batch fewer would skip an all_reduce and the others would hang.
"""

from __future__ import annotations

import math

import torch

from course_lib.core.checks import positive_int
from course_lib.data_parallel.collectives import shard_numel


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The dataset indices rank `rank` of `world_size` visits in `epoch` (same as DistributedSampler)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world_size}")
    positive_int("num_samples", num_samples)
    if shuffle:
        generator = torch.Generator().manual_seed(seed + epoch)
        indices = torch.randperm(num_samples, generator=generator).tolist()
    else:
        indices = list(range(num_samples))
    if drop_last and num_samples % world_size:
        per_rank = num_samples // world_size  # drop the tail so every rank gets the same count
    else:
        per_rank = shard_numel(num_samples, world_size)
    total = per_rank * world_size
    if total > len(indices):  # pad by wrapping around (repeat the start of the permutation)
        padding = total - len(indices)
        indices += (indices * math.ceil(padding / len(indices)))[:padding]
    indices = indices[:total]
    return indices[rank:total:world_size]

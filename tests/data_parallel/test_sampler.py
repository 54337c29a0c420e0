"""shard_indices is DistributedSampler: disjoint, covering, reshuffled per epoch, padded or dropped evenly."""

import pytest
from torch.utils.data.distributed import DistributedSampler

from course_lib.data_parallel.sampler import shard_indices


@pytest.mark.parametrize("num_samples", [1, 7, 10, 16, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (False, False), (True, True), (False, True)])
def test_equals_distributed_sampler(num_samples, world_size, shuffle, drop_last):
    if drop_last and num_samples < world_size:
        pytest.skip("nothing left to shard")
    for epoch in (0, 3):
        for rank in range(world_size):
            sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                         seed=5, drop_last=drop_last)
            sampler.set_epoch(epoch)
            assert shard_indices(num_samples, rank, world_size, shuffle=shuffle, seed=5, epoch=epoch,
                                 drop_last=drop_last) == list(sampler)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shards_disjoint_and_covering(world_size):
    num_samples = 12 * world_size
    shards = [set(shard_indices(num_samples, r, world_size, epoch=1)) for r in range(world_size)]
    assert set().union(*shards) == set(range(num_samples))
    assert sum(len(s) for s in shards) == num_samples  # no index on two ranks


def test_uneven_last_batch_padded_or_dropped():
    padded = [shard_indices(10, r, 4, shuffle=False) for r in range(4)]
    assert [len(s) for s in padded] == [3, 3, 3, 3]
    assert sorted(sum(padded, [])) == sorted(list(range(10)) + [0, 1])  # two samples repeated
    dropped = [shard_indices(10, r, 4, shuffle=False, drop_last=True) for r in range(4)]
    assert [len(s) for s in dropped] == [2, 2, 2, 2]


def test_set_epoch_reshuffles():
    assert shard_indices(100, 0, 2, epoch=0) != shard_indices(100, 0, 2, epoch=1)
    assert shard_indices(100, 0, 2, epoch=0) == shard_indices(100, 0, 2, epoch=0)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="rank=4, world_size=4"):
        shard_indices(10, 4, 4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 8, 16])
def test_padding_longer_than_the_permutation_equals_distributed_sampler(world_size):
    # num_samples < world_size pads with more entries than the permutation has: it repeats more than once
    for num_samples in range(1, 3 * world_size + 2):
        for rank in range(world_size):
            for shuffle in (True, False):
                sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                             seed=2)
                sampler.set_epoch(1)
                got = shard_indices(num_samples, rank, world_size, shuffle=shuffle, seed=2, epoch=1)
                assert got == list(sampler), (num_samples, rank, world_size, shuffle)
                assert len(got) == -(-num_samples // world_size)

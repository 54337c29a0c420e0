"""course_lib.data_parallel.loading: windows, per-rank shard files, loaders whose worker count never changes the data,
and the wait-vs-compute measurement that shows workers curing a slow input pipeline."""

import time

import numpy as np
import pytest
import torch

from course_lib.data_parallel.loading import (
    PipelineTiming,
    TokenWindowDataset,
    compare_workers,
    make_loader,
    rank_dataset,
    rank_shards,
    read_shard_index,
    time_input_pipeline,
    write_token_shards,
)


def stream(n=1000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.long)


def test_windows_are_the_right_slices_of_a_tensor_and_of_a_file(tmp_path):
    tokens = stream(103)
    path = tmp_path / "tokens.bin"
    tokens.numpy().astype(np.uint8).tofile(path)
    for source in (tokens, path):
        ds = TokenWindowDataset(source, seq_len=10)
        assert len(ds) == 10  # 103 tokens: starts 0, 10, ..., 90
        for i in (0, 3, 9, -1):
            start = (i % 10) * 10
            assert torch.equal(ds[i], tokens[start:start + 10])
            assert ds[i].dtype == torch.long
        with pytest.raises(IndexError):
            ds[10]
    overlapping = TokenWindowDataset(tokens, seq_len=10, stride=3)
    assert len(overlapping) == (103 - 10) // 3 + 1
    assert torch.equal(overlapping[5], tokens[15:25])


def test_file_dataset_pickles_without_its_memory_map(tmp_path):
    import pickle

    path = tmp_path / "tokens.bin"
    stream(5000).numpy().astype(np.uint8).tofile(path)
    ds = TokenWindowDataset(path, seq_len=16)
    ds[0]  # opens the memory map
    assert len(pickle.dumps(ds)) < 1000  # the file's 5000 bytes are not in the pickle
    assert torch.equal(pickle.loads(pickle.dumps(ds))[7], ds[7])


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindowDataset(stream(10), seq_len=0)
    with pytest.raises(ValueError, match="no window"):
        TokenWindowDataset(stream(5), seq_len=8)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        TokenWindowDataset(tmp_path / "missing.bin", seq_len=8)
    with pytest.raises(ValueError, match="delay_kind"):
        TokenWindowDataset(stream(10), seq_len=2, delay_kind="network")


@pytest.mark.parametrize(("num_shards", "world_size"), [(2, 2), (4, 2), (6, 3), (1, 1)])
def test_shards_are_disjoint_equal_and_cover_the_stream(tmp_path, num_shards, world_size):
    tokens = stream(1003)
    paths = write_token_shards(tokens, tmp_path, num_shards)
    per_shard = 1003 // num_shards
    index = read_shard_index(tmp_path)
    assert index["tokens_per_shard"] == per_shard and index["dropped_tokens"] == 1003 - num_shards * per_shard
    pieces = [np.fromfile(p, dtype=np.uint8) for p in paths]
    assert all(len(piece) == per_shard for piece in pieces)
    assert np.array_equal(np.concatenate(pieces), tokens[:num_shards * per_shard].numpy())  # in order, no gap
    owned = [rank_shards(num_shards, r, world_size) for r in range(world_size)]
    assert sorted(k for shards in owned for k in shards) == list(range(num_shards))  # each shard exactly once
    assert len({len(shards) for shards in owned}) == 1  # equal shares
    # Each rank's dataset reads exactly the windows of its own shards.
    seq_len = 10
    for rank in range(world_size):
        ds = rank_dataset(tmp_path, rank, world_size, seq_len)
        expected = [torch.from_numpy(pieces[k][i * seq_len:(i + 1) * seq_len].astype(np.int64))
                    for k in owned[rank] for i in range(per_shard // seq_len)]
        assert len(ds) == len(expected)
        for got, want in zip((ds[i] for i in range(len(ds))), expected):
            assert torch.equal(got, want)


def test_uneven_shards_and_missing_index_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be split evenly over 2 ranks"):
        rank_shards(3, 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        rank_shards(4, 2, 2)
    with pytest.raises(FileNotFoundError, match="index.json"):
        rank_dataset(tmp_path, 0, 1, 8)
    with pytest.raises(ValueError, match="0..255"):
        write_token_shards(torch.tensor([1, 300]), tmp_path, 1)


def test_worker_count_does_not_change_the_samples_or_their_order():
    ds = TokenWindowDataset(stream(4000), seq_len=16)
    reference = [b for b in make_loader(ds, 8, num_workers=0, shuffle=True, seed=3)]
    for workers in (1, 2):
        loader = make_loader(ds, 8, num_workers=workers, prefetch_factor=2, shuffle=True, seed=3)
        got = list(loader)
        assert len(got) == len(reference)
        assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert not torch.equal(reference[0], next(iter(make_loader(ds, 8, shuffle=False))))  # shuffle did something


def test_sharded_loaders_split_the_windows_between_ranks():
    ds = TokenWindowDataset(torch.arange(40 * 4) % 256, seq_len=4)  # window i starts with token 4i
    seen = []
    for rank in range(4):
        first = [b for b in make_loader(ds, 2, rank=rank, world_size=4, shuffle=True, seed=1)]
        again = [b for b in make_loader(ds, 2, rank=rank, world_size=4, shuffle=True, seed=1, num_workers=2)]
        assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(first) == len(again) == 5
        seen += [int(row[0]) // 4 for batch in first for row in batch]
    assert sorted(seen) == list(range(40))  # disjoint and covering
    with pytest.raises(ValueError, match="both rank and world_size"):
        make_loader(ds, 2, rank=0)


def test_loader_settings_apply_only_where_they_mean_something():
    ds = TokenWindowDataset(stream(100), seq_len=4)
    plain = make_loader(ds, 4)
    assert plain.prefetch_factor is None and not plain.persistent_workers
    assert plain.pin_memory == torch.cuda.is_available()
    workers = make_loader(ds, 4, num_workers=2, prefetch_factor=3)
    assert workers.prefetch_factor == 3 and workers.persistent_workers


def test_time_input_pipeline_separates_waiting_from_computing():
    ds = TokenWindowDataset(stream(2000), seq_len=8, sample_delay_s=0.002)
    timing = time_input_pipeline(make_loader(ds, 4), lambda batch: time.sleep(0.01), steps=5, warmup=1)
    assert len(timing.wait_s) == len(timing.compute_s) == 5
    assert timing.wait >= 4 * 0.002 and timing.compute >= 0.01  # 4 samples per batch; the step's sleep
    assert 0 < timing.data_fraction < 1
    with pytest.raises(ValueError, match="ran out after 3 batches"):
        time_input_pipeline(make_loader(TokenWindowDataset(stream(24), seq_len=8), 1), print, steps=5, warmup=0)


def test_workers_cure_a_slow_input_pipeline():
    """Loading a batch takes 8 x 5 ms; the step computes for 10 ms. Without workers the step waits for the whole
    load; with 4 workers loading in parallel (while the step computes) the wait must at least halve."""
    ds = TokenWindowDataset(stream(20_000), seq_len=16, sample_delay_s=0.005)
    start = time.perf_counter()
    timings = compare_workers(ds, lambda batch: time.sleep(0.01), (0, 4), batch_size=8, steps=10)
    assert all(isinstance(t, PipelineTiming) for t in timings.values())
    assert timings[0].wait >= 8 * 0.005
    assert timings[4].wait < 0.5 * timings[0].wait, {w: t.wait for w, t in timings.items()}
    assert timings[4].step < timings[0].step
    assert time.perf_counter() - start < 20

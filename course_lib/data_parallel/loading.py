"""Data at scale: token shards per rank, a Dataset of windows, DataLoader workers, and the wait for data.

    python -m course_lib.data_parallel.loading                      # wait vs compute for 0, 1, 2, 4 workers, slow storage
    python -m course_lib.data_parallel.loading --sample_delay_ms 0  # fast storage: one worker is enough

A training step should never wait for its batch. Reading and decoding a batch (load time L) and computing on
it (compute time C) overlap when DataLoader workers prepare the next batches in other processes. With W
workers reading in parallel, the steady-state step takes about

    step ≈ max(C, L / W)        and the step waits        wait ≈ max(0, L / W - C)

so a data-bound job (L > C) needs W ≥ L / C workers (and the cores or the storage bandwidth to run them).
prefetch_factor batches per worker are queued ahead; the queue absorbs jitter but cannot raise the rate.

Sharding: `write_token_shards` cuts one token stream into equal contiguous shard files; rank r of W reads
shards r, r + W, r + 2W, ... (`rank_shards`) and memory-maps only those (`rank_dataset`). The alternative
keeps one file and gives each rank every W-th window with a DistributedSampler (`make_loader(rank=...)`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, RandomSampler

from course_lib.core.checks import positive_int
from course_lib.core.data import load_tokens, prepare_tokens
from course_lib.core.steps import train_step
from course_lib.observability.timing import machine_line
from course_lib.parity import seeded_gpt

SHARD_INDEX = "index.json"
DELAY_KINDS = ("io", "cpu")


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.bin"


class TokenWindowDataset(Dataset):
    """Item i: the seq_len tokens starting at i * stride, as a torch.long tensor (map-style, random access).

    source: a uint8 token file (memory-mapped lazily, in each process that reads it) or a 1-D tensor/array.
    stride: distance between window starts (default seq_len: non-overlapping windows).
    sample_delay_s: extra time per item, to simulate slow storage: delay_kind "io" sleeps (waiting on remote
    storage, the CPU is free) and "cpu" spins (decompressing or decoding, the CPU is busy).
    """

    def __init__(self, source, seq_len: int, *, stride: int | None = None, sample_delay_s: float = 0.0,
                 delay_kind: str = "io"):
        positive_int("seq_len", seq_len)
        self.stride = seq_len if stride is None else stride
        positive_int("stride", self.stride)
        if sample_delay_s < 0 or delay_kind not in DELAY_KINDS:
            raise ValueError(f"sample_delay_s must be >= 0 and delay_kind one of {DELAY_KINDS}, "
                             f"got {sample_delay_s!r}, {delay_kind!r}")
        self.seq_len, self.sample_delay_s, self.delay_kind = seq_len, sample_delay_s, delay_kind
        if isinstance(source, (str, os.PathLike)):
            self.path, self._array = Path(source), None
            if not self.path.is_file():
                raise FileNotFoundError(f"token file {self.path} does not exist")
            num_tokens = self.path.stat().st_size  # uint8: one byte per token
        else:
            array = source.numpy() if isinstance(source, torch.Tensor) else np.asarray(source)
            if array.ndim != 1:
                raise ValueError(f"source must be a 1-D token stream, got shape {array.shape}")
            self.path, self._array = None, array
            num_tokens = len(array)
        if num_tokens < seq_len:
            raise ValueError(f"{num_tokens} tokens hold no window of seq_len={seq_len}")
        self.num_tokens = num_tokens

    def tokens(self) -> np.ndarray:
        """The token stream; a file is memory-mapped on first use (the OS pages in only what is read)."""
        if self._array is None:
            self._array = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._array

    def __getstate__(self):
        # Workers reopen the file themselves: never pickle a memory map (that would copy the whole file).
        state = dict(self.__dict__)
        if self.path is not None:
            state["_array"] = None
        return state

    def __len__(self) -> int:
        return (self.num_tokens - self.seq_len) // self.stride + 1

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.stride
        if self.sample_delay_s:
            if self.delay_kind == "io":
                time.sleep(self.sample_delay_s)
            else:
                end = time.perf_counter() + self.sample_delay_s
                while time.perf_counter() < end:
                    pass
        return torch.from_numpy(np.array(self.tokens()[start:start + self.seq_len], dtype=np.int64))


def _as_array(tokens) -> np.ndarray:
    if isinstance(tokens, (str, os.PathLike)):
        return np.memmap(tokens, dtype=np.uint8, mode="r")
    array = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError("token shards are uint8 files: every token id must be in 0..255")
    return array.astype(np.uint8, copy=False)


def write_token_shards(tokens, directory, num_shards: int) -> list[Path]:
    """Cut a token stream (tensor, array or uint8 file) into num_shards equal contiguous uint8 files.

    Shard k holds tokens [k * S, (k + 1) * S) with S = len(tokens) // num_shards; the last len % num_shards
    tokens are dropped (equal shards: equal steps on every rank). index.json is written last and lists the
    shards: a directory without it is an interrupted write. Returns the shard paths in order.
    """
    array = _as_array(tokens)
    positive_int("num_shards", num_shards)
    per_shard = len(array) // num_shards
    if per_shard < 1:
        raise ValueError(f"{len(array)} tokens cannot fill {num_shards} shards")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SHARD_INDEX).unlink(missing_ok=True)
    paths = []
    for k in range(num_shards):
        path = directory / shard_name(k)
        tmp = path.with_name(path.name + ".tmp")
        array[k * per_shard:(k + 1) * per_shard].tofile(tmp)
        os.replace(tmp, path)
        paths.append(path)
    index = {"num_shards": num_shards, "tokens_per_shard": per_shard, "dtype": "uint8",
             "dropped_tokens": len(array) - num_shards * per_shard, "shards": [p.name for p in paths]}
    tmp = directory / (SHARD_INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, directory / SHARD_INDEX)
    return paths


def read_shard_index(directory) -> dict:
    path = Path(directory) / SHARD_INDEX
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {directory} holds no complete set of token shards "
                                "(write them with course_lib.data_parallel.loading.write_token_shards)")
    return json.loads(path.read_text())


def rank_shards(num_shards: int, rank: int, world_size: int) -> list[int]:
    """Shard numbers of `rank`: rank, rank + world_size, ... Every rank gets the same count, or an error."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world_size}")
    if num_shards % world_size:
        raise ValueError(f"{num_shards} shards cannot be split evenly over {world_size} ranks: some ranks would "
                         "run more steps than others and wait forever in an all_reduce; write a multiple of "
                         "world_size shards")
    return list(range(rank, num_shards, world_size))


def rank_dataset(directory, rank: int, world_size: int, seq_len: int, **window_options) -> Dataset:
    """The windows of this rank's shards only (each memory-mapped lazily); window_options go to TokenWindowDataset."""
    index = read_shard_index(directory)
    parts = [TokenWindowDataset(Path(directory) / index["shards"][k], seq_len, **window_options)
             for k in rank_shards(index["num_shards"], rank, world_size)]
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def make_loader(dataset: Dataset, batch_size: int, *, num_workers: int = 0, prefetch_factor: int = 2,
                pin_memory: bool | None = None, persistent_workers: bool | None = None, shuffle: bool = False,
                seed: int = 0, rank: int | None = None, world_size: int | None = None,
                drop_last: bool = True) -> DataLoader:
    """A DataLoader with the settings that matter at scale, each only where it means something.

    rank/world_size: read every world_size-th sample through a DistributedSampler (call its set_epoch each
    epoch). pin_memory: None means "if CUDA is available" (page-locked host memory only speeds up copies to a
    GPU). prefetch_factor and persistent_workers apply only with num_workers > 0; persistent_workers (default
    then) keeps the worker processes alive between epochs instead of starting them again.
    """
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size (a sharded loader), or neither")
    if rank is not None:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
    elif shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = None  # sequential
    workers = num_workers > 0
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      num_workers=num_workers, prefetch_factor=prefetch_factor if workers else None,
                      persistent_workers=(workers if persistent_workers is None else persistent_workers and workers),
                      pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)


@dataclass(frozen=True)
class PipelineTiming:
    """Per-step seconds spent waiting for the next batch and computing on it (warm-up excluded)."""

    wait_s: tuple[float, ...]
    compute_s: tuple[float, ...]

    @property
    def wait(self) -> float:
        return statistics.median(self.wait_s)

    @property
    def compute(self) -> float:
        return statistics.median(self.compute_s)

    @property
    def step(self) -> float:
        return statistics.median(w + c for w, c in zip(self.wait_s, self.compute_s))

    @property
    def data_fraction(self) -> float:
        """Share of the step spent waiting for data (medians): 0 means the input pipeline keeps up."""
        return self.wait / (self.wait + self.compute)


def time_input_pipeline(loader, step_fn: Callable[[torch.Tensor], object], *, steps: int, warmup: int = 2,
                        sync: Callable[[], None] | None = None) -> PipelineTiming:
    """Run step_fn on warmup + steps batches of loader; time next(batch) and step_fn(batch) separately.

    Warm-up steps start the workers and drain the batches they prefetched while nobody was reading, so the
    medians describe the steady state. sync (torch.cuda.synchronize on a GPU) makes the compute time real.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    iterator, waits, computes = iter(loader), [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError(f"the loader ran out after {i} batches; warmup + steps = {warmup + steps}: "
                             "use fewer steps or a larger dataset") from None
        ready = time.perf_counter()
        step_fn(batch)
        if sync is not None:
            sync()
        if i >= warmup:
            waits.append(ready - start)
            computes.append(time.perf_counter() - ready)
    return PipelineTiming(tuple(waits), tuple(computes))


def make_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device | str = "cpu") -> Callable[[torch.Tensor], float]:
    """step(batch) -> loss: copy to device (non_blocking, useful from pinned memory), forward, backward, update."""
    device = torch.device(device)

    def step(batch: torch.Tensor) -> float:
        batch = batch.to(device, non_blocking=True)
        # the loss as a number waits for the device: the step is really done
        return train_step(model, [batch], optimizer, grad_norm=False)["loss"]
    return step


def compare_workers(dataset: Dataset, step_fn, worker_counts=(0, 1, 2, 4), *, batch_size: int = 16,
                    steps: int = 20, prefetch_factor: int = 2, rounds: int = 1) -> dict[int, PipelineTiming]:
    """time_input_pipeline for each worker count, in turn (rounds > 1: A B C A B C ..., samples pooled).

    Variants run in consecutive blocks, not step by step: an idle loader's workers keep filling its queue, so
    interleaving single steps would hide every wait. Each block gets a fresh loader whose workers stop when the
    block ends (idle workers of another variant must not compete for the cores), and first drains the
    batches its workers prefetched before the first step.
    """
    waits = {w: [] for w in worker_counts}
    computes = {w: [] for w in worker_counts}
    with warnings.catch_warnings():  # more workers than cores is part of the comparison: no warning about it
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for _ in range(rounds):
            for w in worker_counts:
                loader = make_loader(dataset, batch_size, num_workers=w, prefetch_factor=prefetch_factor,
                                     shuffle=True, persistent_workers=False)
                timing = time_input_pipeline(loader, step_fn, steps=steps, warmup=w * prefetch_factor + 2)
                waits[w] += timing.wait_s
                computes[w] += timing.compute_s
    return {w: PipelineTiming(tuple(waits[w]), tuple(computes[w])) for w in worker_counts}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample_delay_ms", type=float, default=4.0, help="simulated storage time per window")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process; workers "
                        "get one each")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = seeded_gpt(0, "tiny")
    step = make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    dataset = TokenWindowDataset(Path(args.data_dir) / "train.bin" if (Path(args.data_dir) / "train.bin").exists()
                                 else load_tokens("train", args.data_dir), model.config.block_size,
                                 sample_delay_s=args.sample_delay_ms / 1e3)
    print(machine_line(setup=f"training process {args.threads} thread(s), each worker 1"))
    print(f"{'workers':>7} {'wait ms':>8} {'compute ms':>11} {'step ms':>8} {'waiting':>8}")
    for w, t in compare_workers(dataset, step, args.workers, batch_size=args.batch_size, steps=args.steps).items():
        print(f"{w:>7} {t.wait * 1e3:>8.1f} {t.compute * 1e3:>11.1f} {t.step * 1e3:>8.1f} {t.data_fraction:>8.0%}")


if __name__ == "__main__":
    main()


def ensure_shards(data_dir: str, shard_dir: str, num_shards: int) -> None:
    """Rank 0 writes the training split as num_shards shard files (unless they exist); the others wait at a barrier."""
    index = Path(shard_dir) / SHARD_INDEX
    if dist.get_rank() == 0 and (not index.is_file() or read_shard_index(shard_dir)["num_shards"] != num_shards):
        prepare_tokens(data_dir, progress=False)
        write_token_shards(load_tokens("train", data_dir), shard_dir, num_shards)
    dist.barrier()

"""Rank workers for ranked checkpoints: save on N ranks, load on M (resharded), refuse a mismatch; why a reader
waits at a barrier for the rank that writes (`barrier_race`); DDP training that logs per rank, aggregates to rank 0
and writes ranked checkpoints (`train_logged`).

Rank workers that grade Session C's checkpoint exercise: the learner's ranked save on every rank.

    ranks = launch(check_ranked_save, 3, args=(spawnable(save_ranked), str(directory)))

The worker records, per rank, every torch.save (the file and the tensor's size) and every rename onto a file
(the atomic write of the manifest), and makes one rank slow to write its shard, so that a manifest written
before the other ranks are done shows up in the files' modification times. Rank 0 also reports each file's
size on disk: torch.save of a slice writes the whole storage the slice views, so a shard saved without
.clone() holds every rank's numbers, which the tensor's numel does not show.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.checkpoint import ranked
from course_lib.checkpoint.atomic import atomic_write
from course_lib.checkpoint.ranked import load_ranked_checkpoint, read_manifest, save_ranked_checkpoint
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPTConfig
from course_lib.core.steps import train_step
from course_lib.data_parallel.collectives import gather_to_rank0, mean_over_ranks, rank_tag
from course_lib.data_parallel.loading import ensure_shards, make_loader, rank_dataset
from course_lib.parity import flat_parameters, seeded_gpt
from course_lib.runtime.env import get_dist_info

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


def barrier_race(directory: str, rounds: int = 3, save_seconds: float = 0.5) -> dict:
    """Each round rank 0 writes checkpoint `round` to latest.pt (slowly, as a large one would be written) and
    every rank then loads latest.pt, first without a barrier between the two, then with one. Without it the
    other ranks read what was there before: no file at all, or the previous round's. Returns, per variant,
    the step this rank loaded in each round ('missing' if there was no file)."""
    info = get_dist_info()
    path = Path(directory) / "latest.pt"
    out = {"rank": info.rank, "expected": list(range(1, rounds + 1))}
    for variant in ("without barrier", "with barrier"):
        if info.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        dist.barrier()  # both variants start from an empty directory
        loaded = []
        for step in range(1, rounds + 1):
            if info.rank == 0:
                time.sleep(save_seconds)
                atomic_write(path, lambda f, step=step: torch.save({"step": step, "weights": torch.full((4,), 1.0 * step)}, f))
                log.info("%s %s: saved step %d", rank_tag(), variant, step)
            if variant == "with barrier":
                dist.barrier()  # nobody reads before rank 0 has finished writing
            try:
                got = torch.load(path, weights_only=True)["step"]
            except FileNotFoundError:
                got = "missing"
            log.info("%s %s: expected step %d, loaded %s", rank_tag(), variant, step, got)
            loaded.append(got)
            dist.barrier()  # stands for the next training step's all_reduce, which lines the ranks up again
        out[variant] = loaded
    return out


def train_logged(out_dir: str, data_dir: str = "data", steps: int = 100, micro_batch: int = 8, seq_len: int = 64,
                 preset: str = "tiny", lr: float = 3e-3, seed: int = 0, log_every: int = 10, ckpt_every: int = 50,
                 num_workers: int = 0) -> dict:
    """torch DDP on this rank's token shards, with logs aggregated on rank 0 and ranked checkpoints.

    Every log_every steps: the mean loss over ranks (all_reduce, known everywhere) and every rank's own
    numbers (gather to rank 0), which rank 0 appends to <out_dir>/metrics.jsonl and writes as TensorBoard scalars
    to <out_dir>/tb (the mean loss and one loss curve per rank). Every ckpt_every steps and at
    the end: a ranked checkpoint in <out_dir>/step_<N>/.
    """
    info = get_dist_info()
    out = Path(out_dir)
    ensure_shards(data_dir, str(out / "shards"), num_shards=info.world_size)
    loader = make_loader(rank_dataset(out / "shards", info.rank, info.world_size, seq_len), micro_batch,
                         num_workers=num_workers, shuffle=True, seed=seed + info.rank)
    model = seeded_gpt(seed, preset, block_size=seq_len).to(info.device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    batches, local, rows, checkpoints = iter(loader), [], [], []
    metrics = MetricsLogger(out, tensorboard=True) if info.rank == 0 else None  # one writer: rank 0
    window = {"loss": [], "wait_s": [], "step_s": []}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:  # end of this rank's shard: next epoch (every rank has the same count)
            batches = iter(loader)
            batch = next(batches)
        ready = time.perf_counter()
        # DDP all-reduces the gradients in backward
        loss = train_step(ddp, [batch.to(info.device)], optimizer, grad_norm=False)["loss"]
        window["loss"].append(loss)
        window["wait_s"].append(ready - start)
        window["step_s"].append(time.perf_counter() - start)
        local.append({"step": step, "loss": loss})
        if step % log_every == 0 or step == steps:
            mine = {"rank": info.rank, "loss": statistics.mean(window["loss"]),
                    "wait_ms": 1e3 * statistics.median(window["wait_s"]),
                    "step_ms": 1e3 * statistics.median(window["step_s"]),
                    "tokens_per_s": micro_batch * seq_len / statistics.median(window["step_s"])}
            mean_loss = mean_over_ranks(mine["loss"])  # every rank knows it (e.g. to stop early together)
            per_rank = gather_to_rank0(mine)
            log.info("%s step %d | my loss %.4f | mean loss %.4f | wait %.1f ms | step %.1f ms", rank_tag(), step,
                     mine["loss"], mean_loss, mine["wait_ms"], mine["step_ms"])
            if info.rank == 0:
                row = {"step": step, "mean_loss": mean_loss, "tokens_per_s": sum(r["tokens_per_s"] for r in per_rank),
                       "slowest_step_ms": max(r["step_ms"] for r in per_rank),
                       **{f"loss_rank_{r['rank']}": r["loss"] for r in per_rank}, "per_rank": per_rank}
                metrics.log(row)  # a line of metrics.jsonl, and TensorBoard scalars in <out_dir>/tb: one per number
                rows.append(row)
            window = {key: [] for key in window}
        if step % ckpt_every == 0 or step == steps:
            directory = out / f"step_{step:05d}"
            save_ranked_checkpoint(directory, model, step=step, extra={"batches_read": step, "rank": info.rank})
            checkpoints.append(str(directory))
    if metrics is not None:
        metrics.close()
    return {"rank": info.rank, "local": local, "rows": rows, "checkpoints": checkpoints,
            "threads": torch.get_num_threads(), "params": flat_parameters(model)}


SAVE_STEP = 7
SHARD_HEADER_BYTES = 4096
"""Bytes torch.save adds around one 1-D tensor's data (its zip container, the pickle, alignment): 1,549 to
1,605 measured with torch 2.13 for shards named shard_0000r.pt; 4 KiB leaves room for other versions."""


def saved_model(seed: int = 0):
    """The model every rank holds when it saves (identical replicas, as in data parallelism)."""
    return seeded_gpt(seed + 7, "tiny")


def check_ranked_save(save_fn, directory: str, *, slow_rank: int = 1, delay_s: float = 0.3, seed: int = 0) -> dict:
    """Worker: save_fn(directory, model, step) on every rank; returns what this rank saved and renamed."""
    rank = dist.get_rank()
    model = saved_model(seed)
    saves, renames = [], []
    real_save, real_replace, real_rename = torch.save, os.replace, os.rename

    def recording_save(obj, f, *args, **kwargs):
        if rank == slow_rank:
            time.sleep(delay_s)  # a slow file system: this rank's shard lands last
        numel = obj.numel() if isinstance(obj, torch.Tensor) else None
        if isinstance(obj, dict):
            numel = sum(v.numel() for v in obj.values() if isinstance(v, torch.Tensor))
        saves.append({"path": os.fspath(f) if isinstance(f, (str, os.PathLike)) else None, "numel": numel})
        return real_save(obj, f, *args, **kwargs)

    def recording(real):
        def rename(src, dst, *args, **kwargs):
            renames.append({"src": os.fspath(src), "dst": os.fspath(dst)})
            return real(src, dst, *args, **kwargs)
        return rename

    error = None
    with mock.patch.object(torch, "save", recording_save), mock.patch.object(os, "replace", recording(real_replace)), \
            mock.patch.object(os, "rename", recording(real_rename)):
        try:
            save_fn(directory, model, SAVE_STEP)
        except Exception as err:  # noqa: BLE001 (reported to the test cell)
            error = f"{type(err).__name__}: {err}"
    dist.barrier()  # every rank has returned: the directory is complete if the save was right
    paths = list(Path(directory).iterdir()) if rank == 0 and Path(directory).is_dir() else []
    files = {p.name: p.stat().st_mtime_ns for p in paths}
    sizes = {p.name: p.stat().st_size for p in paths}
    return {"rank": rank, "error": error, "saves": saves, "renames": renames, "files": files, "sizes": sizes}

"""Rank workers and rank-side helpers of Session C: barriers, aggregated logging, ranked checkpoints, data
per rank, and step time split into compute and communication.

Each worker runs inside every rank of a course_lib.launch job (spawned ranks import it by module path) and
returns plain data for the notebook:

    from course_lib.launch import launch
    from course_lib.session_c_workers import barrier_race, train_logged, scaling_sweep
    launch(barrier_race, 2, kwargs=dict(directory="runs/race"))
    launch(train_logged, 2, kwargs=dict(out_dir="runs/ranked", data_dir="data", steps=100))
    launch(scaling_sweep, 4, kwargs=dict(world_sizes=(1, 2, 4)))      # groups of 1, 2, 4 ranks take turns

The helpers (rank_tag, mean_over_ranks, gather_to_rank0) also serve scripts started by
scripts/fake_multi_node_launcher.py or torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.checkpoint import atomic_write
from course_lib.dataloading import SHARD_INDEX, make_loader, rank_dataset, read_shard_index, write_token_shards
from course_lib.dist import get_dist_info
from course_lib.model import GPT, GPTConfig
from course_lib.ranked_checkpoint import load_ranked_checkpoint, read_manifest, save_ranked_checkpoint

log = logging.getLogger("course")  # course_lib.launch sends it to logs/rank_<r>/train.log


# ------------------------------------------------------------------------------------------------ helpers
def rank_tag() -> str:
    """'[node n | local l | rank r]': where this process sits in the job (NODE_RANK, else rank // ranks per node)."""
    info = get_dist_info()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    node = int(os.environ.get("NODE_RANK", info.rank // max(per_node, 1)))
    return f"[node {node} | local {info.local_rank} | rank {info.rank}]"


def mean_over_ranks(value: float, group=None) -> float:
    """The mean of a number over the ranks, known to every rank (all_reduce SUM / n; gloo has no AVG)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=get_dist_info().device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.item() / dist.get_world_size(group)


def gather_to_rank0(obj) -> list | None:
    """Every rank's object, in rank order, on rank 0 (None elsewhere): one message per rank, not a file each."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _slowest(seconds: float, group=None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


# ----------------------------------------------------------------------------------------------- barriers
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


# ------------------------------------------------------------------------- training with aggregated logs
def ensure_shards(data_dir: str, shard_dir: str, num_shards: int) -> None:
    """Rank 0 writes the training split as num_shards shard files (unless they exist); the others wait at a barrier."""
    index = Path(shard_dir) / SHARD_INDEX
    if dist.get_rank() == 0 and (not index.is_file() or read_shard_index(shard_dir)["num_shards"] != num_shards):
        from course_lib.data import load_tokens, prepare_tokens

        prepare_tokens(data_dir, progress=False)
        write_token_shards(load_tokens("train", data_dir), shard_dir, num_shards)
    dist.barrier()


def train_logged(out_dir: str, data_dir: str = "data", steps: int = 100, micro_batch: int = 8, seq_len: int = 64,
                 preset: str = "tiny", lr: float = 3e-3, seed: int = 0, log_every: int = 10, ckpt_every: int = 50,
                 num_workers: int = 0) -> dict:
    """torch DDP on this rank's token shards, with logs aggregated on rank 0 and ranked checkpoints.

    Every log_every steps: the mean loss over ranks (all_reduce, known everywhere) and every rank's own
    numbers (gather to rank 0), which rank 0 appends to <out_dir>/metrics.jsonl. Every ckpt_every steps and at
    the end: a ranked checkpoint in <out_dir>/step_<N>/.
    """
    info = get_dist_info()
    out = Path(out_dir)
    ensure_shards(data_dir, str(out / "shards"), num_shards=info.world_size)
    loader = make_loader(rank_dataset(out / "shards", info.rank, info.world_size, seq_len), micro_batch,
                         num_workers=num_workers, shuffle=True, seed=seed + info.rank)
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset(preset, block_size=seq_len)).to(info.device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    batches, local, rows, checkpoints = iter(loader), [], [], []
    window = {"loss": [], "wait_s": [], "step_s": []}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:  # end of this rank's shard: next epoch (every rank has the same count)
            batches = iter(loader)
            batch = next(batches)
        ready = time.perf_counter()
        batch = batch.to(info.device)
        _, loss = ddp(batch, targets=batch)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window["loss"].append(loss.item())
        window["wait_s"].append(ready - start)
        window["step_s"].append(time.perf_counter() - start)
        local.append({"step": step, "loss": loss.item()})
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
                       "slowest_step_ms": max(r["step_ms"] for r in per_rank), "per_rank": per_rank}
                with open(out / "metrics.jsonl", "a") as f:  # one writer: lines never interleave
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
            window = {key: [] for key in window}
        if step % ckpt_every == 0 or step == steps:
            directory = out / f"step_{step:05d}"
            save_ranked_checkpoint(directory, model, step=step, extra={"batches_read": step, "rank": info.rank})
            checkpoints.append(str(directory))
    return {"rank": info.rank, "local": local, "rows": rows, "checkpoints": checkpoints,
            "threads": torch.get_num_threads(), "params": _flat_params(model)}


def load_ranked_here(directory: str, reshard: bool = False) -> dict:
    """Load a ranked checkpoint on this job's ranks (model shape from its manifest); raises if refused."""
    manifest = read_manifest(directory)
    torch.manual_seed(1234)  # other weights than the saved ones: the load must overwrite every parameter
    model = GPT(GPTConfig(**manifest["model_config"]))
    result = load_ranked_checkpoint(directory, model, reshard=reshard)
    return {"rank": get_dist_info().rank, "step": result["step"], "saved_by": result["world_size"],
            "resharded": result["resharded"], "extra": result["extra"], "params": _flat_params(model)}


def refuse_then_reshard(directory: str) -> dict:
    """Both answers to a world-size change in one job: the refusal's message, then a resharded load."""
    try:
        load_ranked_here(directory, reshard=False)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"refused": refused, **load_ranked_here(directory, reshard=True)}


# --------------------------------------------------------------------------------------- data per rank
def mapped_files(folder: str) -> list[str]:
    """Files under folder that this process has memory-mapped (Linux /proc/self/maps; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    folder = str(Path(folder).resolve())
    return sorted({Path(line.split()[-1]).name for line in lines if line.split()[-1].startswith(folder)})


def data_per_rank(shard_dir: str, seq_len: int = 64, micro_batch: int = 16, steps: int = 12,
                  configs=({"num_workers": 0}, {"num_workers": 2}), slow_rank: int = 1,
                  sample_delay_s: float = 0.004, seed: int = 0) -> dict:
    """Which shard files this rank maps, then DDP training where one rank's storage is slow, per config.

    Rank `slow_rank` reads every window with sample_delay_s of extra latency (a slow disk or a remote bucket);
    the others read at full speed. Per config and step: this rank's wait for data and the rest of the step
    (forward, backward with the gradient all-reduce, update). Medians after 2 warm-up steps.
    """
    info = get_dist_info()
    own = rank_dataset(shard_dir, info.rank, info.world_size, seq_len)
    for part in getattr(own, "datasets", [own]):  # a ConcatDataset when the rank owns several shards
        part.tokens()  # memory-maps this rank's shard files, and only those
    first = own[0]
    out = {"rank": info.rank, "mapped": mapped_files(shard_dir), "first_window": first[:12].tolist(), "configs": []}
    del own
    for config in configs:
        delay = sample_delay_s if info.rank == slow_rank else 0.0
        dataset = rank_dataset(shard_dir, info.rank, info.world_size, seq_len, sample_delay_s=delay)
        workers = config.get("num_workers", 0)
        loader = make_loader(dataset, micro_batch, shuffle=True, seed=seed, num_workers=workers,
                             prefetch_factor=config.get("prefetch_factor", 2))
        torch.manual_seed(seed)
        model = GPT(GPTConfig.from_preset("tiny", block_size=seq_len))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches, waits, rests = iter(loader), [], []
        warmup = 2 + workers * config.get("prefetch_factor", 2)  # drain what the workers prefetched
        dist.barrier()
        for step in range(warmup + steps):
            start = time.perf_counter()
            batch = next(batches)
            ready = time.perf_counter()
            _, loss = ddp(batch, targets=batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup:
                waits.append(ready - start)
                rests.append(time.perf_counter() - ready)
        del batches  # stop this config's workers before the next config starts its own
        out["configs"].append({**config, "slow": delay > 0, "wait_ms": 1e3 * statistics.median(waits),
                               "rest_ms": 1e3 * statistics.median(rests),
                               "step_ms": 1e3 * statistics.median(w + r for w, r in zip(waits, rests))})
    return out


# ------------------------------------------------------------------------------------- scaling sweep
def scaling_sweep(world_sizes=(1, 2, 4), steps: int = 10, warmup: int = 2, micro_batch: int = 8, seq_len: int = 64,
                  preset: str = "tiny", seed: int = 0) -> dict:
    """Step time versus world size at a fixed batch per rank, split into compute and communication.

    Launch max(world_sizes) ranks; the first n ranks form the group of world size n and the groups take turns
    step by step (the others wait at a barrier), so every world size sees the same machine load. A step is
    forward + backward (compute), one all_reduce of all gradients as a single flat buffer (communication),
    then the optimizer update (compute). The step time is the group's slowest rank; its compute part is the
    largest compute time of any rank in the group, and communication is the rest: the all_reduce itself plus
    waiting for the slowest rank to arrive.
    """
    info = get_dist_info()
    if max(world_sizes) > info.world_size:
        raise ValueError(f"launch max(world_sizes)={max(world_sizes)} ranks, got {info.world_size}")
    groups = {n: dist.new_group(list(range(n))) for n in world_sizes}  # every rank creates every group
    replicas = {}
    for n in world_sizes:
        if info.rank < n:
            torch.manual_seed(seed)
            model = GPT(GPTConfig.from_preset(preset, block_size=seq_len))
            replicas[n] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(seed + 1 + info.rank)
    samples = {n: [] for n in replicas}
    for step in range(warmup + steps):
        for n in world_sizes:
            dist.barrier()  # one group at a time
            if n not in replicas:
                continue
            model, optimizer = replicas[n]
            batch = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=generator)
            start = time.perf_counter()
            _, loss = model(batch, targets=batch)
            loss.backward()
            backward_done = time.perf_counter()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # one message of 4N bytes
            dist.all_reduce(flat, group=groups[n])
            reduced = time.perf_counter()
            flat /= n
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end = time.perf_counter()
            mine = torch.tensor([(backward_done - start) + (end - reduced), end - start], dtype=torch.float64)
            everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
            dist.all_gather(everyone, mine, group=groups[n])
            if step >= warmup:
                compute = max(t[0].item() for t in everyone)
                total = max(t[1].item() for t in everyone)
                samples[n].append((compute, total))
    dist.barrier()
    results = {}
    for n, pairs in samples.items():
        model = replicas[n][0]
        compute = statistics.median(c for c, _ in pairs)
        step_s = statistics.median(t for _, t in pairs)
        results[n] = {"compute_s": compute, "step_s": step_s, "comm_s": max(step_s - compute, 0.0),
                      "grad_bytes": 4 * model.num_params(),
                      "tokens_per_s": n * micro_batch * seq_len / step_s, "params": _flat_params(model)}
    return {"rank": info.rank, "threads": torch.get_num_threads(), "groups": results}

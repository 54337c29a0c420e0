"""Bytes of model states one rank holds: measured from its live tensors, and predicted by the ZeRO formulas.

What is counted (measure_model_states), in bytes, each storage once:
- params: the model's parameters (for a DTensor, FSDP2's local shard) plus extra["params"] (ZeRO-3's shard);
- grads: their .grad plus extra["grads"] (ZeRO-2/3's gradient shard);
- optimizer_states: every tensor in optimizer.state plus extra["optimizer_states"] (ZeRO's exp_avg,
  exp_avg_sq and, in mixed precision, the fp32 master shard). Step counters are included here and also
  reported on their own as step_counters: torch's AdamW keeps one fp32 `step` tensor (4 bytes) per
  parameter tensor; course_lib.sharding.zero counts steps in a Python int (0 bytes).

A tensor counts the whole storage behind it (untyped_storage().nbytes(), which is numel * element_size
for a tensor that owns its storage): views into one buffer count once, and a shard narrowed out of a padded
buffer counts the padding, as the allocator does. Buffers that are not parameters (RoPE tables),
activations and the allocator's cache are not model states and are not counted.

The formulas (expected_model_states), per rank, Psi = n_params, N = world_size, S = ceil(Psi / N):

    precision   params  grads  K (optimizer)                        stage 1 shards K, 2 also grads, 3 also params
    fp32        4       4      8   (Adam m and v)                   a sharded term is bytes * S: the flat
    mixed       2       2      12  (fp32 master, m and v)           vector is padded to S * N elements

    python -m course_lib.sharding.model_states --params 102762 --world-size 4 --precision mixed
"""

from __future__ import annotations

import argparse

import torch

from course_lib.core.checks import positive_ints
from course_lib.memory.accounting import OPTIMIZER_STATES, PRECISION_BYTES, format_bytes
from course_lib.memory.formulas import zero_memory_per_gpu
from course_lib.data_parallel.collectives import shard_numel
from course_lib.sharding.zero import STAGES

KINDS = ("params", "grads", "optimizer_states")
SHARDED_FROM_STAGE = {"optimizer_states": 1, "grads": 2, "params": 3}  # the definition of the three stages
STEP_COUNTER_BYTES = 4  # torch.optim.AdamW's state["step"]: a 0-dim fp32 tensor per parameter tensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: t.to_local() for a DTensor (FSDP2), t itself otherwise."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        return to_local()


def live_bytes(tensors, seen: set[int] | None = None) -> int:
    """Bytes of the storages behind `tensors`, each storage once (pass `seen` to share it between calls)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def measure_model_states(model: torch.nn.Module, optimizer=None, extra: dict | None = None) -> dict:
    """{params, grads, optimizer_states, step_counters, total} in bytes held by this rank (see module doc).

    Call it where the states are complete: right after optimizer.step() (Adam creates its states lazily,
    and .grad is still there). extra: {kind: [tensors]} for tensors a sharding wrapper keeps outside the
    model and optimizer, kind one of params, grads, optimizer_states.
    """
    extra = extra or {}
    unknown = sorted(set(extra) - set(KINDS))
    if unknown:
        raise ValueError(f"extra has unknown kind(s) {unknown}; use {list(KINDS)}")
    params = list(model.parameters())
    states, counters = [], []
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    (counters if key == "step" else states).append(value)
    seen: set[int] = set()  # shared: a tensor listed under two kinds counts under the first
    measured = {
        "params": live_bytes(params + list(extra.get("params", [])), seen),
        "grads": live_bytes([p.grad for p in params if p.grad is not None] + list(extra.get("grads", [])), seen),
    }
    step_counters = live_bytes(counters, seen)
    measured["optimizer_states"] = live_bytes(states + list(extra.get("optimizer_states", [])), seen) + step_counters
    measured["step_counters"] = step_counters
    measured["total"] = sum(measured[kind] for kind in KINDS)
    return measured


def expected_model_states(n_params: int, world_size: int, stage: int, *, precision: str = "fp32",
                          optimizer: str = "adamw", n_step_counters: int = 0) -> dict:
    """The ZeRO paper's bytes per rank, {params, grads, optimizer_states, step_counters, total}, with padding.

    Unsharded terms are bytes * Psi; sharded ones bytes * ceil(Psi / N). n_step_counters: how many 4-byte
    step tensors the optimizer keeps (torch.optim.AdamW: one per parameter tensor; course_lib.sharding.zero: 0).
    """
    positive_ints(n_params=n_params, world_size=world_size)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if not isinstance(n_step_counters, int) or n_step_counters < 0:
        raise ValueError(f"n_step_counters must be a non-negative integer, got {n_step_counters!r}")
    param_bytes, grad_bytes, master_bytes = PRECISION_BYTES[precision]
    k = master_bytes + 4 * OPTIMIZER_STATES[optimizer]  # fp32 master + fp32 optimizer states per element
    sizes = dict(k=k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    whole = zero_memory_per_gpu(n_params, 1, stage, **sizes)  # one rank: nothing is divided
    padded = shard_numel(n_params, world_size) * world_size
    sharded = zero_memory_per_gpu(padded, world_size, stage, **sizes)  # sharded terms: bytes * S exactly
    expected = {kind: round(getattr(sharded if stage >= SHARDED_FROM_STAGE[kind] else whole, kind))
                for kind in KINDS}
    expected["step_counters"] = STEP_COUNTER_BYTES * n_step_counters
    expected["optimizer_states"] += expected["step_counters"]
    expected["total"] = sum(expected[kind] for kind in KINDS)
    return expected


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, required=True, help="number of parameters Psi")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISION_BYTES))
    args = parser.parse_args(argv)
    S = shard_numel(args.params, args.world_size)
    print(f"Psi = {args.params:,}, N = {args.world_size}: S = ceil(Psi / N) = {S:,} elements per rank, "
          f"{S * args.world_size - args.params} of padding on the last rank; {args.precision} AdamW")
    print(f"{'stage':<7}" + "".join(f"{kind:>18}" for kind in (*KINDS, "total")) + "   (bytes per rank)")
    for stage in STAGES:
        row = expected_model_states(args.params, args.world_size, stage, precision=args.precision)
        print(f"{stage:<7}" + "".join(f"{row[kind]:>18,}" for kind in (*KINDS, "total"))
              + f"   {format_bytes(row['total'])}")

if __name__ == "__main__":
    main()

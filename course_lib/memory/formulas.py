"""Formulas for a GPU cluster job, back-of-the-envelope: memory per GPU under ZeRO, gradient traffic per step,
and how often to checkpoint. Formulas, not measurements: the inputs (link bandwidth, failure rate, write speed)
are yours, and the tables show what they imply.

    python -m course_lib.memory.formulas zero --params 7.5e9 --gpus 64         # the ZeRO paper's Figure 1 example
    python -m course_lib.memory.formulas comm --params 7e9 --gpus 64 --busbw-gbs 50 --tflops 400
    python -m course_lib.memory.formulas checkpoint --params 7e9 --write-gbs 5 --mtbf-hours 12

ZeRO (Rajbhandari et al., 2020), mixed-precision Adam, Psi parameters, N_d data-parallel ranks, K = 12 bytes of
optimizer state per parameter (fp32 master weights, momentum and variance):

    stage 0 (DDP)   (2 + 2 + K) Psi                 stage 2   2 Psi + (2 + K) Psi / N_d
    stage 1         (2 + 2) Psi + K Psi / N_d        stage 3   (2 + 2 + K) Psi / N_d

Communication per rank and step (ring algorithms; S = gradient bytes): DDP and ZeRO-1/2 send 2 (n - 1)/n S
(an all-reduce, or a reduce-scatter plus an all-gather); ZeRO-3 / FSDP send 3 (n - 1)/n S (parameters are
all-gathered twice, for forward and backward). Checkpoint interval: Young's formula sqrt(2 delta M).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from course_lib.core.checks import positive_number
from course_lib.memory.accounting import format_bytes

ADAM_STATE_BYTES = 12  # K of the ZeRO paper: fp32 master weights 4 + momentum 4 + variance 4
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes of model states held by one GPU: 16-bit parameters, 16-bit gradients, optimizer states."""

    stage: int
    params: float
    grads: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_states


def zero_memory_per_gpu(n_params: float, n_gpus: int, stage: int, *, k: int = ADAM_STATE_BYTES,
                        param_bytes: int = 2, grad_bytes: int = 2) -> ZeroMemory:
    """Model-state bytes per GPU for ZeRO `stage` (0 = plain data parallelism) over n_gpus ranks.

    Activations, buffers and the allocator's cache come on top; they are not sharded by ZeRO.
    """
    positive_number("n_params", n_params)
    positive_number("n_gpus", n_gpus, whole=True)
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
    p, g, o = param_bytes * n_params, grad_bytes * n_params, k * n_params
    return ZeroMemory(stage=stage, params=p / n_gpus if stage >= 3 else p, grads=g / n_gpus if stage >= 2 else g,
                      optimizer_states=o / n_gpus if stage >= 1 else o)


def zero_table(n_params: float, n_gpus: int, k: int = ADAM_STATE_BYTES) -> list[dict]:
    """One row per stage: bytes per GPU by kind, and the saving relative to stage 0 at this n_gpus."""
    baseline = zero_memory_per_gpu(n_params, n_gpus, 0, k=k).total
    rows = []
    for stage in ZERO_STAGES:
        m = zero_memory_per_gpu(n_params, n_gpus, stage, k=k)
        rows.append({"stage": stage, "params": m.params, "grads": m.grads, "optimizer_states": m.optimizer_states,
                     "total": m.total, "saving": baseline / m.total})
    return rows


def data_parallel_traffic(n_params: float, n_gpus: int, *, grad_bytes: int = 2, strategy: str = "ddp") -> float:
    """Bytes each rank sends per optimizer step to keep n_gpus replicas in sync (ring algorithms).

    strategy 'ddp' (also ZeRO-1/2: reduce-scatter + all-gather moves the same bytes) or 'zero3' (FSDP full shard).
    """
    positive_number("n_params", n_params)
    positive_number("n_gpus", n_gpus, whole=True)
    passes = {"ddp": 2, "zero3": 3}
    if strategy not in passes:
        raise ValueError(f"strategy must be one of {sorted(passes)}, got {strategy!r}")
    return passes[strategy] * (n_gpus - 1) / n_gpus * grad_bytes * n_params


def comm_seconds(bytes_per_rank: float, busbw_bytes_per_s: float) -> float:
    """Time to move bytes_per_rank at a bus bandwidth busbw (nccl-tests' busbw is exactly traffic per rank / time)."""
    positive_number("busbw_bytes_per_s", busbw_bytes_per_s)
    return bytes_per_rank / busbw_bytes_per_s


def compute_seconds(n_params: float, tokens_per_gpu: float, achieved_flops: float) -> float:
    """Forward + backward time of one step on one GPU: 6 N FLOPs per token at the achieved FLOP/s."""
    positive_number("tokens_per_gpu", tokens_per_gpu)
    positive_number("achieved_flops", achieved_flops)
    return 6 * n_params * tokens_per_gpu / achieved_flops


def break_even_tokens_per_gpu(n_gpus: int, achieved_flops: float, busbw_bytes_per_s: float, *,
                              grad_bytes: int = 2, strategy: str = "ddp") -> float:
    """Tokens per GPU per step at which gradient communication takes as long as compute.

    Both scale with the parameter count, which cancels: 6 N T / F = passes (n-1)/n b N / B gives
    T = passes (n-1)/n b F / (6 B). Below it, even perfect overlap leaves the GPUs waiting for the network.
    """
    per_param = data_parallel_traffic(1, n_gpus, grad_bytes=grad_bytes, strategy=strategy)
    return per_param * achieved_flops / (6 * busbw_bytes_per_s)


def checkpoint_bytes(n_params: float, *, k: int = ADAM_STATE_BYTES, param_bytes: int = 2) -> float:
    """Bytes of a full training checkpoint: 16-bit weights + the K bytes of optimizer state per parameter."""
    positive_number("n_params", n_params)
    return (param_bytes + k) * n_params


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's (1974) checkpoint interval sqrt(2 delta M): delta = time to write one checkpoint, M = job MTBF."""
    positive_number("checkpoint_s", checkpoint_s)
    positive_number("mtbf_s", mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def expected_waste(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Fraction of wall time lost (first order): writing delta/tau, recomputing tau/(2M) and restarting R/M."""
    positive_number("interval_s", interval_s)
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s) + restart_s / mtbf_s


# ---------------------------------------------------------------------------------------------------- the CLI
def _zero(args) -> None:
    print(f"ZeRO model states per GPU: {args.params:.3g} parameters, N_d = {args.gpus}, K = {args.k} "
          "(mixed-precision Adam)")
    print(f"{'stage':<8}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}{'saving':>10}")
    for row in zero_table(args.params, args.gpus, args.k):
        cells = "".join(f"{format_bytes(row[key]):>11}" for key in ("params", "grads", "optimizer_states", "total"))
        print(f"{row['stage']:<8}{cells}{row['saving']:>9.2f}x")
    limits = {1: (4 + args.k) / 4, 2: (4 + args.k) / 2}
    print(f"as N_d grows, the saving tends to {limits[1]:g}x (stage 1), {limits[2]:g}x (stage 2) and N_d (stage 3)")


def _comm(args) -> None:
    flops, busbw = args.tflops * 1e12, args.busbw_gbs * 1e9
    print(f"{args.params:.3g} parameters, {args.gpus} GPUs, {args.grad_bytes}-byte gradients, "
          f"assumed busbw {args.busbw_gbs:g} GB/s, assumed achieved {args.tflops:g} TFLOP/s per GPU")
    print(f"{'strategy':<10}{'bytes/rank':>12}{'comm s':>9}{'compute s':>11}  break-even tokens/GPU/step")
    for strategy in ("ddp", "zero3"):
        traffic = data_parallel_traffic(args.params, args.gpus, grad_bytes=args.grad_bytes, strategy=strategy)
        compute = compute_seconds(args.params, args.tokens_per_gpu, flops)
        even = break_even_tokens_per_gpu(args.gpus, flops, busbw, grad_bytes=args.grad_bytes, strategy=strategy)
        print(f"{strategy:<10}{format_bytes(traffic):>12}{comm_seconds(traffic, busbw):>9.3f}{compute:>11.3f}"
              f"  {even:,.0f}")
    print(f"(compute for {args.tokens_per_gpu:,} tokens per GPU per step)")


def _checkpoint(args) -> None:
    size = checkpoint_bytes(args.params)
    write_s = size / (args.write_gbs * 1e9)
    mtbf_s = args.mtbf_hours * 3600
    best = young_interval(write_s, mtbf_s)
    print(f"checkpoint of {args.params:.3g} parameters: {format_bytes(size)}, written in {write_s:.0f} s at "
          f"{args.write_gbs:g} GB/s; job MTBF {args.mtbf_hours:g} h, restart {args.restart_min:g} min")
    print(f"{'every':>10}{'waste':>9}")
    for minutes in sorted({10, 30, 60, 120, 240, round(best / 60)}):
        waste = expected_waste(minutes * 60, write_s, mtbf_s, args.restart_min * 60)
        mark = "  <- Young's interval" if minutes == round(best / 60) else ""
        print(f"{minutes:>7} min{waste:>8.1%}{mark}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    zero = sub.add_parser("zero", help="model-state memory per GPU for ZeRO stages 0-3")
    zero.add_argument("--params", type=float, required=True)
    zero.add_argument("--gpus", type=int, required=True)
    zero.add_argument("--k", type=int, default=ADAM_STATE_BYTES, help="optimizer bytes per parameter (12: Adam)")
    comm = sub.add_parser("comm", help="gradient traffic and time per step vs compute time")
    comm.add_argument("--params", type=float, required=True)
    comm.add_argument("--gpus", type=int, required=True)
    comm.add_argument("--busbw-gbs", type=float, required=True, help="bus bandwidth in GB/s (nccl-tests busbw)")
    comm.add_argument("--tflops", type=float, required=True, help="achieved TFLOP/s per GPU (peak x MFU)")
    comm.add_argument("--tokens-per-gpu", type=int, default=8192)
    comm.add_argument("--grad-bytes", type=int, default=2)
    ckpt = sub.add_parser("checkpoint", help="checkpoint size, write time and interval")
    ckpt.add_argument("--params", type=float, required=True)
    ckpt.add_argument("--write-gbs", type=float, required=True, help="aggregate write bandwidth in GB/s")
    ckpt.add_argument("--mtbf-hours", type=float, required=True, help="mean time between failures of the job")
    ckpt.add_argument("--restart-min", type=float, default=10.0, help="minutes to requeue, restart and reload")
    args = parser.parse_args(argv)
    {"zero": _zero, "comm": _comm, "checkpoint": _checkpoint}[args.command](args)


if __name__ == "__main__":
    main()

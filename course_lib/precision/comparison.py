"""FP32 vs BF16 vs FP16 with loss scaling: the same model, the same batches, loss curves and tokens/s.

`precision_comparison` builds one copy of the model per precision from the same seed (identical weights),
draws each batch once and gives it to every copy, and runs the training steps taking turns
(fp32, bf16, fp16, fp32, ...), so a slow moment of the machine hits every variant alike (the course's
measuring rules). Throughput is tokens per step / median step time after `warmup_steps`.

- fp32: no autocast;
- bf16: torch.autocast(dtype=torch.bfloat16), no scaler: bf16 has fp32's exponent range;
- fp16: torch.autocast(dtype=torch.float16) + torch.amp.GradScaler. CPU autocast supports float16 in
  the torch this course pins (2.13), so the CPU runs the real recipe; its speed on a CPU says nothing
  about a GPU (CPUs have little or no fp16 matrix hardware; fp16 and bf16 tensor cores run at the same
  rate on A100/H100).

`underflow_fractions` shows why fp16 needs the scaler and bf16 does not: the share of a real gradient's
nonzero elements that become 0 when stored in each format, with and without a loss scale.

    python -m course_lib.precision.comparison --steps 30
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from course_lib.core.data import RandomBatches, synthetic_tokens
from course_lib.core.model import GPTConfig
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import train_step
from course_lib.observability.timing import machine_line, setup_threads
from course_lib.parity import seeded_gpt

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check(precisions, steps: int, warmup_steps: int) -> None:
    unknown = [p for p in precisions if p not in AMP_DTYPES]
    if unknown or not precisions:
        raise ValueError(f"precisions must be a non-empty selection of {list(AMP_DTYPES)}, got {list(precisions)}")
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, got {steps!r}")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < steps:
        raise ValueError(f"warmup_steps must be an integer in [0, steps), got {warmup_steps!r}")


def precision_comparison(tokens: torch.Tensor | None = None, *, precisions=("fp32", "bf16", "fp16"),
                         preset: str = "tiny", steps: int = 30, batch_size: int = 8, seq_len: int = 64,
                         lr: float = 3e-3, grad_clip: float = 1.0, seed: int = 0, warmup_steps: int = 3,
                         device: str = "cpu") -> dict[str, dict]:
    """Train one copy of the model per precision, taking turns step by step; returns {precision: run}.

    tokens: a 1-D token stream (default: course_lib.core.data.synthetic_tokens). Each run holds losses,
    step_seconds, median_step_s, tokens_per_s and, for fp16, scales and skipped_steps (overflow: the
    scaler skipped the optimizer step and halved the scale).
    """
    _check(precisions, steps, warmup_steps)
    tokens = synthetic_tokens(50_000, seed=seed) if tokens is None else tokens
    config = GPTConfig.from_preset(preset, block_size=max(seq_len, GPTConfig.from_preset(preset).block_size))
    runs = {}
    for name in precisions:
        model = seeded_gpt(seed, config=config).to(device)  # every copy starts from the same weights
        runs[name] = {"model": model, "optimizer": configure_optimizer(model, lr), "losses": [], "step_seconds": [],
                      "scaler": torch.amp.GradScaler(device) if name == "fp16" else None,
                      "scales": [], "skipped_steps": []}
    batches = RandomBatches(tokens, batch_size, seq_len, seed=seed)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for step in range(steps):
        batch = next(batches).to(device)
        for name, run in runs.items():
            scaler = run["scaler"]
            scale = scaler.get_scale() if scaler is not None else None
            sync()
            start = time.perf_counter()
            result = train_step(run["model"], [batch], run["optimizer"], scaler=scaler, grad_clip=grad_clip,
                                amp_dtype=AMP_DTYPES[name])
            sync()
            run["step_seconds"].append(time.perf_counter() - start)
            run["losses"].append(result["loss"])
            if scaler is not None:
                run["scales"].append(scale)
                if scaler.get_scale() < scale:  # the scaler halves its scale exactly when it skips a step
                    run["skipped_steps"].append(step)
    tokens_per_step = batch_size * seq_len
    for run in runs.values():
        run["median_step_s"] = statistics.median(run["step_seconds"][warmup_steps:])
        run["tokens_per_s"] = tokens_per_step / run["median_step_s"]
        del run["model"], run["optimizer"], run["scaler"]
    return runs


def max_loss_gap(runs: dict, a: str = "fp32", b: str = "bf16") -> float:
    """Largest |loss_a - loss_b| over the steps of two runs of precision_comparison."""
    return max(abs(x - y) for x, y in zip(runs[a]["losses"], runs[b]["losses"]))


def step_noise(losses) -> float:
    """Std of the step-to-step changes of a loss curve / sqrt 2: the noise the batches alone put on one loss."""
    diffs = [b - a for a, b in zip(losses, losses[1:])]
    mean = sum(diffs) / len(diffs)
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / len(diffs)) / math.sqrt(2)


def gradient_sample(preset: str = "tiny", batch_size: int = 8, seq_len: int = 64, seed: int = 0) -> torch.Tensor:
    """All gradient elements of one fp32 backward of an untrained model, as one flat fp32 tensor."""
    model = seeded_gpt(seed, preset)
    idx = torch.randint(0, model.config.vocab_size, (batch_size, seq_len))
    _, loss = model(idx, targets=idx)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def underflow_fractions(grads: torch.Tensor, scales=(1.0, 2.0**16)) -> list[dict]:
    """Per loss scale: share of the nonzero elements of `grads` that become 0 when stored in fp16 / bf16
    ("fp16", "bf16"), and that fp16 stores as subnormals, below its smallest normal 6.1e-5, with fewer
    than its 11 significant bits ("fp16_subnormal")."""
    nonzero = grads[grads != 0].double()
    if nonzero.numel() == 0:
        raise ValueError("grads has no nonzero element")
    rows = []
    for scale in scales:
        scaled = nonzero * scale
        row = {"scale": scale}
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            row[name] = (scaled.to(dtype) == 0).double().mean().item()
        stored = scaled.to(torch.float16)
        subnormal = (stored != 0) & (stored.abs() < torch.finfo(torch.float16).tiny)
        row["fp16_subnormal"] = subnormal.double().mean().item()
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    setup_threads()
    runs = precision_comparison(preset=args.preset, steps=args.steps, batch_size=args.batch_size,
                                seq_len=args.seq_len)
    print(machine_line())
    for name, run in runs.items():
        extra = f", skipped steps {run['skipped_steps']}" if name == "fp16" else ""
        print(f"{name}: loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}, median step "
              f"{run['median_step_s'] * 1e3:.1f} ms, {run['tokens_per_s']:,.0f} tokens/s{extra}")
    print(f"max |fp32 - bf16| loss gap {max_loss_gap(runs):.4f}; "
          f"fp32 step noise {step_noise(runs['fp32']['losses']):.4f}")
    for row in underflow_fractions(gradient_sample(args.preset)):
        print(f"scale {row['scale']:>8g}: gradient elements lost in fp16 {row['fp16']:.2%} (subnormal "
              f"{row['fp16_subnormal']:.2%}), in bf16 {row['bf16']:.2%}")


if __name__ == "__main__":
    main()

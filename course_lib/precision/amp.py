"""Mixed precision made visible: number ranges, autocast, and what loss scaling does when fp16 overflows.

    python -m course_lib.precision.amp      # prints the range table and a loss-scaling run with injected overflows

fp16 has 5 exponent bits (largest finite 65504, smallest normal 6.1e-5): small gradients underflow to zero and
large ones overflow to inf. GradScaler multiplies the loss by a scale S before backward, so gradients are S
times larger (no underflow); before the optimizer step it divides them by S and, if any is inf/NaN, skips the
step and halves S. After `growth_interval` clean steps it doubles S again. bf16 keeps fp32's 8 exponent bits
(range to 3.4e38) with fewer mantissa bits, so it needs no loss scaling — the reason it is preferred.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.core.steps import train_step

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def range_table(values=(1e-8, 1e-5, 0.1, 1.0 + 1e-3, 300.0, 7e4, 1e5, 1e39)) -> list[dict]:
    """Each value as stored in fp32, fp16 and bf16 (shows underflow, overflow and rounding)."""
    rows = []
    for value in values:
        row = {"value": value}
        for name, dtype in DTYPES.items():
            row[name] = torch.tensor(value, dtype=torch.float64).to(dtype).item()
        rows.append(row)
    return rows


def dtype_limits() -> list[dict]:
    """Largest finite value, smallest normal value and machine epsilon of each dtype."""
    return [{"dtype": name, "max": torch.finfo(dtype).max, "smallest_normal": torch.finfo(dtype).tiny,
             "eps": torch.finfo(dtype).eps} for name, dtype in DTYPES.items()]


def loss_scaling_run(steps: int = 12, overflow_steps=(3, 4), init_scale: float = 2.0**16,
                     growth_interval: int = 3, seed: int = 0, device: str = "cpu") -> list[dict]:
    """Train a small regression model with fp16 autocast + GradScaler; inject inf gradients at overflow_steps.

    Returns one record per step: the scale used, whether the optimizer step was skipped, and the loss.
    A skipped step leaves the weights unchanged and halves the scale; clean steps eventually double it.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=growth_interval)
    inputs = torch.randn(64, 16, device=device)
    targets = inputs[:, :1] * 2.0
    records = []
    def forward_backward(micro_batches, spike: bool):
        (x,) = micro_batches
        with torch.autocast(device_type=device, dtype=torch.float16):
            prediction = model(x)
        loss = (prediction.float() - targets).pow(2).mean()
        scaled = scaler.scale(loss)
        if spike:
            scaled = scaled * 1e38  # the kind of spike that overflows fp16 gradients
        scaled.backward()
        return loss.detach()

    for step in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        # the scaler unscales, skips the update if a gradient is inf or NaN, and updates its scale
        stats = train_step(model, [inputs], optimizer, scaler=scaler, grad_norm=False,
                           forward_backward=lambda micro_batches: forward_backward(micro_batches, step in overflow_steps))
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        records.append({"step": step, "scale": scale, "skipped": skipped, "loss": stats["loss"]})
    return records


def underflow_demo(gradient: float = 1e-6, scale: float = 2.0**16) -> dict:
    """A small gradient stored in fp16 with and without loss scaling."""
    unscaled = torch.tensor(gradient).to(torch.float16).item()
    scaled = (torch.tensor(gradient * scale).to(torch.float16).float() / scale).item()
    return {"true": gradient, "fp16": unscaled, "fp16_scaled_then_unscaled": scaled}


if __name__ == "__main__":
    for row in dtype_limits():
        print(f"{row['dtype']:>5}: max {row['max']:.3g}, smallest normal {row['smallest_normal']:.3g}, "
              f"eps {row['eps']:.3g}")
    for row in range_table():
        print("  ".join(f"{k}={v:.6g}" for k, v in row.items()))
    print(underflow_demo())
    for record in loss_scaling_run():
        print(record)

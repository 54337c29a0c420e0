"""Why models outgrow one device: bytes per parameter for training, estimated and measured.

Training keeps more than the weights in memory. Per parameter, with Adam(W):

    fp32:   weights 4 + gradients 4 + Adam m 4 + Adam v 4                     = 16 bytes
    mixed:  bf16 weights 2 + bf16 gradients 2 + fp32 master 4 + m 4 + v 4     = 16 bytes

so a 7B-parameter model needs 7e9 * 16 B = 112 GB before a single activation is stored: more than
one 80 GB GPU. Activations come on top and grow with batch size and sequence length.

Print the table for the course's presets and a 7B model:

    python -m course_lib.memory.accounting
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from course_lib.core.checks import positive_int
from course_lib.core.model import PRESETS, GPTConfig

# Bytes per parameter of (weights, gradients, fp32 master copy) for each precision recipe.
PRECISION_BYTES = {
    "fp32": (4, 4, 0),
    # bf16/fp16 weights and gradients for compute; the optimizer updates an fp32 master copy because
    # small updates vanish when added to a 16-bit weight.
    "mixed": (2, 2, 4),
}
# fp32 state tensors the optimizer keeps per parameter.
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}

GPU_80GB = 80 * 10**9
"""Memory of one 80 GB data-centre GPU (A100/H100 80GB), in bytes (decimal GB, like every figure here)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to train a model, by kind. Activations are whatever the caller passes in."""

    n_params: int
    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    activations: int = 0

    @property
    def model_states(self) -> int:
        """Everything that scales with the parameter count (all but activations)."""
        return self.weights + self.gradients + self.master_weights + self.optimizer_states

    @property
    def total(self) -> int:
        return self.model_states + self.activations

    @property
    def bytes_per_param(self) -> float:
        return self.model_states / self.n_params


def count_parameters(config: GPTConfig) -> int:
    """Parameters of course_lib.core.model.GPT(config), from the shapes alone (no tensors are built).

    tok_emb V*C (lm_head is tied to it) + per block [4 C^2 attention + 3 C F SwiGLU + 2 C norms] + C final norm.
    """
    C, F = config.n_embd, config.ffn_hidden
    per_block = 4 * C * C + 3 * C * F + 2 * C
    return config.vocab_size * C + config.n_layer * per_block + C


def estimate_training_memory(n_params: int, *, precision: str = "fp32", optimizer: str = "adamw",
                             activations: int = 0) -> MemoryEstimate:
    """Bytes to train n_params parameters with the given precision recipe and optimizer.

    precision: 'fp32' or 'mixed' (16-bit weights/gradients + fp32 master weights);
    optimizer: 'sgd', 'sgd_momentum', 'adam' or 'adamw' (its states are fp32);
    activations: bytes of saved activations, if you know them (they depend on batch and sequence length).
    """
    positive_int("n_params", n_params)
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    weight_b, grad_b, master_b = PRECISION_BYTES[precision]
    return MemoryEstimate(
        n_params=n_params,
        weights=weight_b * n_params,
        gradients=grad_b * n_params,
        master_weights=master_b * n_params,
        optimizer_states=4 * OPTIMIZER_STATES[optimizer] * n_params,
        activations=activations,
    )


def measure_training_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of the live weight, gradient and optimizer-state tensors, each storage counted once.

    Call it after at least one optimizer step (Adam creates its states lazily). Tied weights share a
    storage and count once, as they do in memory.
    """
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    params = list(model.parameters())
    states = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states.extend(v for v in state.values() if torch.is_tensor(v))
    return {
        "weights": nbytes(params),
        "gradients": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_states": nbytes(states),
    }


def format_bytes(n: float) -> str:
    """Decimal units (1 GB = 1e9 bytes), as GPU datasheets quote them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def memory_table(n_params_by_name: dict[str, int], *, precision: str = "fp32", optimizer: str = "adamw",
                 device_bytes: int = GPU_80GB) -> str:
    """A text table: parameters, bytes by kind, total, and whether the model states fit on one device."""
    header = (f"{'model':<14}{'params':>16}{'weights':>11}{'grads':>11}{'master':>11}"
              f"{'optimizer':>11}{'total':>11}  fits on {format_bytes(device_bytes)}?")
    lines = [f"precision={precision}, optimizer={optimizer}", header, "-" * len(header)]
    for name, n in n_params_by_name.items():
        e = estimate_training_memory(n, precision=precision, optimizer=optimizer)
        cells = (e.weights, e.gradients, e.master_weights, e.optimizer_states, e.total)
        fits = "yes" if e.total <= device_bytes else f"no ({e.total / device_bytes:.1f}x)"
        lines.append(f"{name:<14}{n:>16,}" + "".join(f"{format_bytes(c):>11}" for c in cells) + f"  {fits}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISION_BYTES))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    args = parser.parse_args(argv)
    counts = {name: count_parameters(cfg) for name, cfg in PRESETS.items()}
    counts["7B"] = 7 * 10**9
    print(memory_table(counts, precision=args.precision, optimizer=args.optimizer))


if __name__ == "__main__":
    main()

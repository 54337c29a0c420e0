"""LoRA (low-rank adaptation, Hu et al. 2021): fine-tune a frozen model through small added matrices.

A linear layer y = W x (W: out x in) gets a trainable update of rank r, scaled by alpha / r:

    y = W x + (alpha / r) * B (A x)        A: r x in (random init), B: out x r (zeros)

B starts at zero, so the adapted model computes exactly what the base model did, and training moves
away from it. Only A and B are trained: r * (in + out) parameters per layer instead of in * out, and
the optimizer keeps its two AdamW states for those only. After training, merge() folds the update into
one plain nn.Linear with weight W + (alpha / r) B A: no extra cost at inference.

The adapters are applied from outside (course_lib.core.model is untouched), by attribute name:

    from course_lib.finetune.lora import apply_lora, merge_lora, parameter_counts
    adapted = apply_lora(model, targets=("q_proj", "v_proj"), r=8, alpha=16)   # freezes everything else
    parameter_counts(model)         # {'trainable': ..., 'total': ..., 'frozen': ...}
    merge_lora(model)               # back to plain nn.Linear layers, same outputs

    python -m course_lib.finetune.lora       # parameter counts and memory of full vs LoRA fine-tuning per preset

`fine_tuning_text()` is the new text the course fine-tunes on: the Python source of course_lib itself,
code rather than the English prose of the pre-training corpus, shipped with the package (no download).
"""

from __future__ import annotations

import argparse
import math
import time
from importlib import resources

import torch
import torch.nn as nn

from course_lib.core.checks import positive_int
from course_lib.core.data import RandomBatches
from course_lib.core.model import PRESETS, GPTConfig
from course_lib.core.optim import configure_optimizer, make_scheduler
from course_lib.core.steps import evaluate, train_step
from course_lib.memory.accounting import count_parameters, format_bytes

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ("q_proj", "v_proj")
"""The original paper's choice: adapt the query and value projections of every attention layer."""


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: base(x) + (alpha / r) * lora_B(lora_A(x)).

    lora_A: nn.Linear(in, r), weight r x in, Kaiming-uniform like any nn.Linear (and peft);
    lora_B: nn.Linear(r, out), weight out x r, zeros, so the layer starts equal to base.
    dropout acts on the input of the update only (the base path sees x unchanged).
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        positive_int("LoRA rank r", r)
        if r > min(base.in_features, base.out_features):
            raise ValueError(f"LoRA rank r={r} exceeds min(in_features, out_features) = "
                             f"{min(base.in_features, base.out_features)}: a full-rank update needs no LoRA")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {alpha!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **factory)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * self.lora_B(self.lora_A(self.dropout(x)))

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) * B @ A: the out x in matrix the adapter adds to base.weight."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """A new plain nn.Linear computing what this layer computes (in eval mode); self is left unchanged."""
        base = self.base
        merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                           device=base.weight.device, dtype=base.weight.dtype)
        merged.weight.copy_(base.weight + self.delta_weight())
        if base.bias is not None:
            merged.bias.copy_(base.bias)
        return merged

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}"


def _check_targets(targets) -> tuple[str, ...]:
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets must be a non-empty sequence of module names such as {DEFAULT_TARGETS}, "
                         f"got {targets!r}")
    return targets


def apply_lora(model: nn.Module, targets=DEFAULT_TARGETS, r: int = 8, alpha: float = 16,
               dropout: float = 0.0) -> list[str]:
    """Freeze every parameter of model, then replace each nn.Linear whose attribute name is in targets
    (e.g. "q_proj" matches blocks.0.attn.q_proj) by a LoRALinear. Returns the replaced modules' names.

    Every target must match at least one nn.Linear; a misspelt name raises an error listing the
    linear layers the model has, instead of silently fine-tuning nothing.
    """
    targets = _check_targets(targets)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters: merge_lora(model) first, or train these")
    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for target in targets:
        matches = [name for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == target]
        if not matches:
            raise ValueError(f"LoRA target {target!r} matches no module; the model's nn.Linear layers are "
                             f"named {sorted(linear_names)}")
        wrong = [name for name in matches if not isinstance(model.get_submodule(name), nn.Linear)]
        if wrong:
            raise ValueError(f"LoRA target {target!r} matches {wrong}, which is not an nn.Linear "
                             f"({type(model.get_submodule(wrong[0])).__name__})")
    model.requires_grad_(False)
    replaced = []
    for name, module in list(model.named_modules()):
        if name and name.rsplit(".", 1)[-1] in targets and isinstance(module, nn.Linear):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, LoRALinear(module, r=r, alpha=alpha, dropout=dropout))
            replaced.append(name)
    return replaced


def merge_lora(model: nn.Module) -> list[str]:
    """Replace every LoRALinear in model by its merged nn.Linear (in place); returns the merged names.

    The merged layers are frozen like the rest of the model was; call requires_grad_(True) to train on.
    """
    merged = []
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, module.merge().requires_grad_(False))
            merged.append(name)
    return merged


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors (lora_A / lora_B weights): what a LoRA fine-tune needs to save."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Trainable, frozen and total parameters, each tensor once (a tied embedding counts once)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "frozen": total - trainable, "total": total}


def lora_parameter_count(config: GPTConfig, targets=DEFAULT_TARGETS, r: int = 8) -> int:
    """r * (in + out) for every adapted layer of course_lib.core.model.GPT(config), from the shapes alone."""
    targets = _check_targets(targets)
    C, F = config.n_embd, config.ffn_hidden
    shapes = {name: (C, C) for name in ATTENTION_TARGETS} | {"gate_proj": (C, F), "up_proj": (C, F),
                                                             "down_proj": (F, C)}
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown} for course_lib.core.model.GPT; choose from {sorted(shapes)}")
    return config.n_layer * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


def fine_tuning_memory(n_params: int, n_trainable: int, *, weight_bytes: int = 4) -> dict[str, int]:
    """Bytes of weights, gradients and AdamW states when n_trainable of n_params parameters are trained.

    Frozen weights may be stored in low precision (weight_bytes=2 for bf16, as QLoRA goes to 4 bits);
    trained ones are fp32 with an fp32 gradient and AdamW's two fp32 states (m and v).
    Activations come on top and do not shrink with LoRA: backward still runs through every layer.
    """
    frozen = n_params - n_trainable
    memory = {"weights": frozen * weight_bytes + 4 * n_trainable, "gradients": 4 * n_trainable,
              "optimizer_states": 8 * n_trainable}
    memory["total"] = sum(memory.values())
    return memory


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer holds in its state (AdamW: exp_avg, exp_avg_sq, step), measured."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


def fine_tuning_text() -> str:
    """The Python source of course_lib's modules, in path order, each introduced by a '# file: <path>' line.

    Code is a new domain for a model pre-trained on English prose: indentation, operators, identifiers.
    It ships with the package, so every machine with the same version of the course gets the same bytes.
    """
    files = sorted(_python_files(resources.files("course_lib")))
    return "".join(f"# file: {path}\n{f.read_text(encoding='utf-8')}\n" for path, f in files)


def _python_files(folder, prefix: str = ""):
    """(path inside course_lib, file) of every .py file below `folder`, sub-packages included."""
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name not in ("corpus", "__pycache__"):
            yield from _python_files(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".py"):
            yield f"{prefix}{entry.name}", entry


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """(train, validation): the last val_fraction of text, moved forward to the start of a file (or a line)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    cut = round(len(text) * (1 - val_fraction))
    boundary = text.find("\n# file: ", cut)
    if boundary < 0:
        boundary = text.find("\n", cut)
    cut = boundary + 1 if boundary >= 0 else cut
    return text[:cut], text[cut:]


def fine_tune(model: nn.Module, tokens: torch.Tensor, *, steps: int, lr: float, batch_size: int = 16,
              block_size: int = 64, eval_sets: dict | None = None, eval_every: int = 0, eval_batches: int = 8,
              seed: int = 0, grad_clip: float = 1.0) -> dict:
    """Train whatever in model requires grad on random windows of tokens (a 1-D token tensor).

    AdamW without weight decay (decay would pull LoRA's B back towards 0, i.e. towards the base model),
    linear warmup over the first tenth, cosine decay to lr / 10, gradient clipping at grad_clip.
    eval_sets {name: tokens}: held-out loss at step 0, every eval_every steps (0: only at the end) and
    at the end. Returns {"losses", "evals": {name: [(step, loss)]}, "optimizer_state_bytes", "seconds"}.
    """
    optimizer = configure_optimizer(model, lr, weight_decay=0.0)
    scheduler = make_scheduler(optimizer, max_lr=lr, min_lr=lr / 10, warmup_steps=steps // 10, max_steps=steps)
    batches = RandomBatches(tokens, batch_size, block_size, seed=seed)
    eval_sets = eval_sets or {}
    evals = {name: [] for name in eval_sets}

    def run_evals(step):
        for name, held_out in eval_sets.items():
            loss = evaluate(model, held_out, batch_size=32, block_size=block_size, max_batches=eval_batches)
            evals[name].append((step, loss))

    run_evals(0)
    losses, seconds = [], 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        losses.append(train_step(model, [next(batches)], optimizer, scheduler, grad_clip=grad_clip)["loss"])
        seconds += time.perf_counter() - start
        if (eval_every and step % eval_every == 0) or step == steps:
            run_evals(step)
    return {"losses": losses, "evals": evals, "optimizer_state_bytes": optimizer_state_bytes(optimizer),
            "seconds": seconds}


def lora_memory_table(targets=DEFAULT_TARGETS, r: int = 8, weight_bytes: int = 4) -> str:
    """Full vs LoRA fine-tuning, per preset and for a LLaMA-7B-shaped config: parameters and bytes."""
    configs = {name: cfg for name, cfg in PRESETS.items()}
    configs["llama-7b shape"] = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
                                          ffn_hidden=11008)
    header = f"{'model':<16}{'params':>15}{'LoRA params':>13}{'share':>8}{'full FT':>11}{'LoRA FT':>11}"
    lines = [f"targets={list(targets)}, r={r}, frozen weights {weight_bytes} bytes each; "
             "weights + gradients + AdamW states (no activations)", header, "-" * len(header)]
    for name, cfg in configs.items():
        n, n_lora = count_parameters(cfg), lora_parameter_count(cfg, targets, r)
        full = fine_tuning_memory(n, n, weight_bytes=4)["total"]
        lora = fine_tuning_memory(n + n_lora, n_lora, weight_bytes=weight_bytes)["total"]
        lines.append(f"{name:<16}{n:>15,}{n_lora:>13,}{n_lora / n:>8.2%}{format_bytes(full):>11}"
                     f"{format_bytes(lora):>11}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated module names")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--weight-bytes", type=int, default=4, help="bytes per frozen weight (2 for bf16)")
    args = parser.parse_args(argv)
    print(lora_memory_table(tuple(args.targets.split(",")), args.r, args.weight_bytes))


if __name__ == "__main__":
    main()

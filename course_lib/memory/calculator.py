"""How much memory does one GPU need? Model states under ZeRO plus activations, for the course's architecture.

`memory_per_gpu` adds four terms, each from a formula the course derives elsewhere:

- parameters, gradients, optimizer states: course_lib.memory.formulas.zero_memory_per_gpu (ZeRO, Rajbhandari et
  al. 2020) with the bytes per parameter of course_lib.memory.accounting (fp32: 4 + 4 + 4k; mixed: 2 + 2 + 4 + 4k,
  k = optimizer state tensors: 2 for Adam). Stage 1 divides the optimizer states by the world size,
  stage 2 also the gradients, stage 3 also the parameters (unpadded: padding is a few elements);
- activations: course_lib.memory.activations's exact formula for course_lib.core.model (checked to the byte
  against saved_tensors_hooks on the CPU), at the micro-batch and sequence length of one GPU. ZeRO does
  not shard activations. "mixed" uses the bf16 formula without autocast's weight copies (the 16-bit
  parameters are what the matmuls save). With activation checkpointing: every block's input plus one
  block's full activations, which backward recomputes one block at a time.

Not counted: the CUDA context (~0.5-1 GB), the allocator's cache and fragmentation, communication buffers,
and under ZeRO-3/FSDP the all-gathered parameters of the layer being computed. Leave ~10% headroom.

    from course_lib.memory.calculator import memory_per_gpu, plot_memory_breakdown
    b = memory_per_gpu("llama-7b-like", world_size=8, zero_stage=3, precision="mixed", seq_len=4096)
    python -m course_lib.memory.calculator --model llama-7b-like --world-size 8 --zero-stage 3
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import matplotlib

if __name__ == "__main__":
    matplotlib.use("Agg")  # the command line has no display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from course_lib.core.checks import one_of, positive_int
from course_lib.core.model import PRESETS, GPTConfig
from course_lib.memory.accounting import GPU_80GB, OPTIMIZER_STATES, PRECISION_BYTES, count_parameters, format_bytes
from course_lib.memory.activations import head_terms, layer_terms
from course_lib.memory.formulas import ZERO_STAGES, zero_memory_per_gpu

H100_80GB = GPU_80GB
MODELS = {**PRESETS,
          # LLaMA shapes with our tied embedding (LLaMA unties it: +0.13B parameters).
          "llama-7b-like": GPTConfig(vocab_size=32000, n_layer=32, n_head=32, n_embd=4096, ffn_hidden=11008,
                                     block_size=4096),
          "llama-13b-like": GPTConfig(vocab_size=32000, n_layer=40, n_head=40, n_embd=5120, ffn_hidden=13824,
                                      block_size=4096)}
SHAPE_ALIASES = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "ffn_hidden", "vocab": "vocab_size"}
KINDS = (("params", "parameters", "#4C72B0"), ("grads", "gradients", "#55A868"),
         ("optimizer_states", "optimizer states", "#DD8452"), ("activations", "activations", "#8172B2"))


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one GPU holds, by kind, and the settings that produced them."""

    params: float
    grads: float
    optimizer_states: float
    activations: float
    n_params: int
    model: str
    world_size: int
    zero_stage: int
    precision: str
    optimizer: str
    activation_checkpointing: bool
    micro_batch: int
    seq_len: int | None
    activations_estimated: bool = True
    """False when only a parameter count was given: no shape, so no activation estimate (0)."""

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def fits(self, device_bytes: float = H100_80GB) -> bool:
        return self.total <= device_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def resolve_model(model) -> tuple[str, GPTConfig | None, int]:
    """(name, config or None, parameter count) of a preset name, a GPTConfig, a shape dict or a count."""
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"model: unknown preset {model!r}; choose one of {sorted(MODELS)}")
        return model, MODELS[model], count_parameters(MODELS[model])
    if isinstance(model, GPTConfig):
        return "custom", model, count_parameters(model)
    if isinstance(model, Mapping):
        fields = {SHAPE_ALIASES.get(k, k): v for k, v in model.items()}
        try:
            config = GPTConfig(**fields)
        except TypeError as error:
            raise ValueError(f"model: a shape dict takes GPTConfig fields or {sorted(SHAPE_ALIASES)}; "
                             f"{error}") from None
        return "custom", config, count_parameters(config)
    if isinstance(model, (int, float)) and not isinstance(model, bool) and model > 0:
        return f"{model:.3g} params", None, int(model)
    raise ValueError(f"model must be a preset name, a GPTConfig, a dict of layers/hidden/heads or a positive "
                     f"parameter count, got {model!r}")


def activation_bytes(config: GPTConfig, micro_batch: int, seq_len: int, *, precision: str = "mixed",
                     activation_checkpointing: bool = False) -> int:
    """Peak bytes of saved activations on one GPU (see the module docstring)."""
    dtype = "fp32" if precision == "fp32" else "bf16"
    config = replace(config, activation_checkpointing=False)
    block = sum(layer_terms(config, micro_batch, seq_len, dtype=dtype, weight_copies=False).values())
    outside = head_terms(config, micro_batch, seq_len, dtype=dtype, weight_copies=False)
    rest = sum(sum(terms.values()) for terms in outside.values())
    if activation_checkpointing:
        kept = sum(layer_terms(config, micro_batch, seq_len, dtype=dtype, activation_checkpointing=True).values())
        return config.n_layer * kept + block + rest
    return config.n_layer * block + rest


def memory_per_gpu(model="llama-7b-like", *, world_size: int = 1, zero_stage: int = 0, precision: str = "mixed",
                   optimizer: str = "adamw", activation_checkpointing: bool = False, micro_batch: int = 1,
                   seq_len: int | None = None, attn_impl: str = "sdpa") -> MemoryBreakdown:
    """Bytes per GPU of parameters, gradients, optimizer states and activations (a MemoryBreakdown).

    model: a name of MODELS, a GPTConfig, a dict such as {"layers": 32, "hidden": 4096, "heads": 32}, or a
    parameter count (then activations are not estimated). seq_len defaults to the config's block_size.
    """
    name, config, n_params = resolve_model(model)
    positive_int("world_size", world_size)
    one_of("zero_stage", zero_stage, ZERO_STAGES)
    one_of("precision", precision, sorted(PRECISION_BYTES))
    one_of("optimizer", optimizer, sorted(OPTIMIZER_STATES))
    one_of("activation_checkpointing", activation_checkpointing, (False, True))
    positive_int("micro_batch", micro_batch)
    one_of("attn_impl", attn_impl, ("sdpa", "explicit"))
    if seq_len is not None:
        if positive_int("seq_len", seq_len) < 2:
            raise ValueError(f"seq_len must be at least 2 (one position predicts the next), got {seq_len}")
    weight_b, grad_b, master_b = PRECISION_BYTES[precision]
    k = master_b + 4 * OPTIMIZER_STATES[optimizer]  # optimizer-side bytes per parameter (ZeRO's K)
    states = zero_memory_per_gpu(n_params, world_size, zero_stage, k=k, param_bytes=weight_b, grad_bytes=grad_b)
    activations = 0
    if config is not None:
        seq_len = seq_len or config.block_size
        activations = activation_bytes(replace(config, attn_impl=attn_impl), micro_batch, seq_len,
                                       precision=precision, activation_checkpointing=activation_checkpointing)
    return MemoryBreakdown(params=states.params, grads=states.grads, optimizer_states=states.optimizer_states,
                           activations=activations, n_params=n_params, model=name, world_size=world_size,
                           zero_stage=zero_stage, precision=precision, optimizer=optimizer,
                           activation_checkpointing=activation_checkpointing, micro_batch=micro_batch,
                           seq_len=seq_len, activations_estimated=config is not None)


def plot_memory_breakdown(breakdowns, *, device_bytes: float = H100_80GB, title: str | None = None,
                          ax=None) -> Figure:
    """Stacked bars of GB per GPU (one per breakdown), a line at the device's memory, fits / does not fit.

    breakdowns: a MemoryBreakdown, or {bar label: MemoryBreakdown}.
    """
    if isinstance(breakdowns, MemoryBreakdown):
        b = breakdowns
        breakdowns = {f"ZeRO-{b.zero_stage}, {b.world_size} GPU{'s' * (b.world_size > 1)}": b}
    if not isinstance(breakdowns, Mapping) or not breakdowns:
        raise ValueError("breakdowns must be a MemoryBreakdown or a non-empty {label: MemoryBreakdown}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(breakdowns) + 2.5), 4.2), layout="constrained")
    fig = ax.figure
    for x, (label, b) in enumerate(breakdowns.items()):
        bottom = 0.0
        for key, name, color in KINDS:
            value = getattr(b, key) / 1e9
            ax.bar(x, value, 0.7, bottom=bottom, color=color, edgecolor="black", linewidth=0.5,
                   label=name if x == 0 else None)
            bottom += value
        fits = b.fits(device_bytes)
        ax.annotate(f"{bottom:.1f} GB\n{'fits' if fits else 'does not fit'}", (x, bottom), ha="center", va="bottom",
                    fontsize=9, xytext=(0, 2), textcoords="offset points", color="black" if fits else "#C44E52")
    ax.axhline(device_bytes / 1e9, color="#C44E52", linestyle="--", linewidth=1)
    ax.annotate(f"H100 {device_bytes / 1e9:.0f} GB", (len(breakdowns) - 0.5, device_bytes / 1e9), ha="right",
                va="bottom", fontsize=9, color="#C44E52", xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(breakdowns)), list(breakdowns), fontsize=9)
    ax.set_xlim(-0.6, len(breakdowns) - 0.4)
    ax.set_ylim(0, 1.25 * max(device_bytes, *(b.total for b in breakdowns.values())) / 1e9)
    ax.set_ylabel("GB per GPU")
    first = next(iter(breakdowns.values()))
    ax.set_title(title or f"{first.model} ({first.n_params / 1e9:.2f}B parameters), {first.precision}, "
                 f"{first.optimizer}, micro-batch {first.micro_batch} x {first.seq_len} tokens", fontsize=10)
    ax.legend(fontsize=9, loc="upper right")
    return fig


def memory_calculator_figure(model: str = "llama-7b-like", world_size: int = 8, seq_len: int = 4096) -> Figure:
    """The book's static figure: ZeRO stages 0-3 on world_size GPUs, without (top) and with (bottom) activation
    checkpointing, drawn at a size whose labels stay readable at the width of a book page."""
    fig, axes = plt.subplots(2, 1, figsize=(8.0, 7.4), layout="constrained", sharey=True)
    n_params, highest = None, H100_80GB
    for ax, checkpointing in zip(axes, (False, True)):
        bars = {f"ZeRO-{stage}": memory_per_gpu(model, world_size=world_size, zero_stage=stage, precision="mixed",
                                                seq_len=seq_len, activation_checkpointing=checkpointing)
                for stage in ZERO_STAGES}
        n_params = next(iter(bars.values())).n_params
        highest = max(highest, *(b.total for b in bars.values()))
        plot_memory_breakdown(bars, ax=ax, title="with activation checkpointing" if checkpointing else
                              "without activation checkpointing")
    axes[0].set_ylim(0, 1.25 * highest / 1e9)  # shared by both panels: room for the tallest bar's label
    fig.suptitle(f"{model} ({n_params / 1e9:.2f}B parameters) on {world_size} GPUs: mixed-precision AdamW, "
                 f"micro-batch 1 x {seq_len} tokens", fontsize=11)
    return fig


class MemoryCalculator:
    """An ipywidgets calculator: controls for every argument of memory_per_gpu, redrawing the bar on change.

        calculator = MemoryCalculator(); display(calculator.widget)
    """

    def __init__(self, device_bytes: float = H100_80GB, **initial):
        import ipywidgets as w  # imported here so that the rest of the module needs no widget library

        self.device_bytes = device_bytes
        self.controls = {
            "model": w.Dropdown(options=list(MODELS), value="llama-7b-like", description="model"),
            "world_size": w.Dropdown(options=[2**i for i in range(11)], value=8, description="GPUs"),
            "zero_stage": w.ToggleButtons(options=list(ZERO_STAGES), value=0, description="ZeRO stage"),
            "precision": w.Dropdown(options=sorted(PRECISION_BYTES), value="mixed", description="precision"),
            "optimizer": w.Dropdown(options=sorted(OPTIMIZER_STATES), value="adamw", description="optimizer"),
            "activation_checkpointing": w.Checkbox(value=False, description="activation checkpointing"),
            "micro_batch": w.IntSlider(value=1, min=1, max=64, description="micro-batch"),
            "seq_len": w.Dropdown(options=[2**i for i in range(7, 16)], value=4096, description="seq len"),
        }
        for key, value in initial.items():
            if key not in self.controls:
                raise ValueError(f"unknown control {key!r}; controls are {sorted(self.controls)}")
            self.controls[key].value = value
        # The bar is a PNG in an Image widget, not a figure drawn into an Output widget: a notebook run headless
        # (papermill, nbconvert) can wait forever on an Output widget's messages (jupyter/nbclient#312).
        self.summary, self.plot = w.HTML(), w.Image(format="png")
        c = self.controls
        self.widget = w.VBox([w.HBox([c["model"], c["world_size"], c["precision"]]), c["zero_stage"],
                              w.HBox([c["optimizer"], c["micro_batch"], c["seq_len"]]),
                              c["activation_checkpointing"], self.summary, self.plot])
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        self.update()

    def values(self) -> dict:
        return {key: control.value for key, control in self.controls.items()}

    def _on_change(self, change) -> None:
        self.update()

    def update(self) -> MemoryBreakdown:
        """Recompute from the controls, redraw the bar into the image, refresh the summary line."""
        self.breakdown = memory_per_gpu(**self.values())
        self.figure = plot_memory_breakdown(self.breakdown, device_bytes=self.device_bytes)
        png = io.BytesIO()
        self.figure.savefig(png, format="png", dpi=90)
        self.plot.value = png.getvalue()
        plt.close(self.figure)  # shown through the image only, not again by the inline backend
        b = self.breakdown
        parts = ", ".join(f"{name} {format_bytes(getattr(b, key))}" for key, name, _ in KINDS)
        verdict = "fits" if b.fits(self.device_bytes) else "does NOT fit"
        self.summary.value = (f"<b>{format_bytes(b.total)} per GPU</b> ({parts}): {verdict} on an "
                              f"{self.device_bytes / 1e9:.0f} GB GPU")
        return b


def memory_calculator_widget(**initial) -> MemoryCalculator:
    """A MemoryCalculator (display `.widget`); keyword arguments set the controls' initial values."""
    return MemoryCalculator(**initial)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b-like", choices=sorted(MODELS))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=None, help="one stage; default: all four")
    parser.add_argument("--precision", default="mixed", choices=sorted(PRECISION_BYTES))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args(argv)
    print(f"{'stage':<7}{'params':>11}{'grads':>11}{'optimizer':>11}{'activations':>13}{'total':>11}  80 GB?")
    for stage in ZERO_STAGES if args.zero_stage is None else (args.zero_stage,):
        b = memory_per_gpu(args.model, world_size=args.world_size, zero_stage=stage, precision=args.precision,
                           optimizer=args.optimizer, activation_checkpointing=args.checkpointing,
                           micro_batch=args.micro_batch, seq_len=args.seq_len)
        cells = "".join(f"{format_bytes(getattr(b, key)):>{13 if key == 'activations' else 11}}" for key, *_ in KINDS)
        print(f"{stage:<7}{cells}{format_bytes(b.total):>11}  {'yes' if b.fits() else 'no'}")
    print(f"{b.model}: {b.n_params:,} parameters, {args.world_size} GPUs, micro-batch {b.micro_batch} x "
          f"{b.seq_len} tokens, {b.precision} {b.optimizer}, checkpointing {b.activation_checkpointing}")


if __name__ == "__main__":
    main()

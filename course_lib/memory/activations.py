"""Activation memory: the bytes autograd saves for backward, measured and predicted to the byte.

Measured: `measure_saved_bytes` runs one training forward (loss included) inside
`torch.autograd.graph.saved_tensors_hooks`; every tensor autograd saves passes through the pack hook, which
adds the size of its *storage*, each storage once (q, k and v of SDPA are views of three storages; the
three bf16 casts of one normalised input under autocast are three storages). Parameters and buffers are
excluded by storage address: a linear layer saves its weight (or a transposed view of it) and RoPE saves
its cos/sin tables, but those bytes live whether or not anything is saved. Bytes are attributed to the
region that was running: "embedding", "block 0".."block L-1" (from the block's input on), "head"
(final norm, lm_head, cross-entropy).

Predicted: `expected_saved_bytes` adds up the terms of `layer_terms` / `head_terms`, derived operation by
operation for course_lib.core.model (RMSNorm, RoPE, SwiGLU, no dropout) on the CPU; a test checks them against
the measurement for several shapes, both attention implementations, fp32 and bf16 autocast, with and
without activation checkpointing. With b = micro-batch, s = sequence length, h = n_embd, a = n_head,
F = ffn_hidden, e = bytes of an activation (4 fp32, 2 bf16), per block:

    RMSNorm x2        2 x (input 4sbh + 1/rms 4sb)   (fp32 residual stream; the fused node recomputes x/rms)
    linear inputs     fp32: 4sbh + 4sbh    bf16: 3 x 2sbh (q,k,v each cast it) + 2 x 2sbh (gate, up)
    q, k, v           3 e sbh              (after RoPE; RoPE itself saves only its cos/sin buffers)
    attention  sdpa   output e sbh + logsumexp 4abs          (o_proj's input is a view of the output)
           explicit   softmax e a s^2 b + causal mask s^2 (bool) + o_proj input e sbh
    SwiGLU            3 e sbF              (gate and up for the fused node, their product for down_proj)
    bf16 only         2 (4h^2 + 3hF)       autocast's bf16 copies of the fp32 weights, saved by the matmuls

fp32 + SDPA: 4 (8 sbh + 3 sbF + 2 sb + abs). bf16 + SDPA: 26 sbh + 6 sbF + 8 sb + 4abs + weight copies.
With activation checkpointing a block saves only its input x (4sbh, the residual stream is fp32) and
recomputes the rest during backward, one block at a time.

Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", count
s b h (34 + 5 a s / h) bytes per layer for GPT-3-style blocks in 16-bit with dropout: 34 sbh = LayerNorm
inputs 4 + QKV input 2 + Q, K 4 + V 2 + o_proj input 2 + attention dropout mask 1 + MLP input 2 + 4h GeLU
input 8 + GeLU output 8 + MLP dropout mask 1; 5 a s^2 b = softmax output 2 + its dropout mask 1 + dropout
output 2. Why our measured numbers differ: (1) no dropout here: -2 sbh of masks and -3 a s^2 b;
(2) SDPA (flash-style) keeps no s x s matrix, only a logsumexp per row (4abs), so the quadratic term
disappears; the explicit path keeps the softmax (e a s^2 b) and a bool mask (s^2); (3) RMSNorm reads the
fp32 residual stream and saves it with 1/rms (4sbh + 4sb per norm, not 2sbh); (4) autocast casts
the normalised input separately for each consuming linear (3 + 2 copies) and keeps bf16 copies of the
weights; (5) SwiGLU with F ~ 8h/3 saves three sbF tensors instead of GeLU's two 4h tensors; (6) the
residual stream stays fp32 under autocast. On a GPU, CUDA autocast runs softmax in fp32 and SDPA's flash
kernel also saves a random-number seed/offset: the GPU numbers differ by such terms, so the tests pin
the CPU.

    python -m course_lib.memory.activations --preset tiny --batch 4 --seq-len 64
    python -m course_lib.memory.activations --preset small --dtype bf16 --attn-impl explicit --checkpointing
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from course_lib.core.checks import positive_ints
from course_lib.core.model import GPT, PRESETS, GPTConfig
from course_lib.memory.accounting import format_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class SavedBytes:
    """What one forward saved for backward: bytes per region, and one record per new storage."""

    by_region: dict[str, int]
    records: list[dict] = field(default_factory=list)
    excluded_state_bytes: int = 0
    """Bytes of parameter/buffer storages that were saved (referenced, not new memory): not in by_region."""

    @property
    def total(self) -> int:
        return sum(self.by_region.values())


def _check_shape(config: GPTConfig, batch: int, seq_len: int, dtype: str) -> None:
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    for name, value, low in (("batch", batch, 1), ("seq_len", seq_len, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if config.dropout != 0.0:
        raise ValueError(f"the exact formula assumes GPTConfig.dropout == 0 (dropout saves masks), "
                         f"got dropout={config.dropout}")


def layer_terms(config: GPTConfig, batch: int, seq_len: int, *, dtype: str = "fp32",
                activation_checkpointing: bool | None = None, weight_copies: bool = True) -> dict[str, int]:
    """Bytes one block saves for backward, term by term (see the module docstring for the derivation).

    weight_copies=False leaves out autocast's bf16 weight copies: with 16-bit parameters (ZeRO's mixed
    recipe, FSDP's param_dtype) the matmuls save the parameters themselves, which are no new memory.
    """
    _check_shape(config, batch, seq_len, dtype)
    b, s, h, a, F = batch, seq_len, config.n_embd, config.n_head, config.ffn_hidden
    e, sbh = DTYPE_BYTES[dtype], seq_len * batch * config.n_embd
    checkpointing = config.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    if checkpointing:
        return {"block input x (fp32, kept for the recomputation)": 4 * sbh}
    fp32 = dtype == "fp32"
    terms = {
        "attn_norm: input (fp32 residual stream)": 4 * sbh,
        "attn_norm: 1/rms (fp32)": 4 * s * b,
        "q/k/v_proj input" + ("" if fp32 else " (3 bf16 casts)"): 4 * sbh if fp32 else 3 * 2 * sbh,
        "q, k, v after RoPE": 3 * e * sbh,
    }
    if config.attn_impl == "sdpa":
        terms["attention output (= o_proj input)"] = e * sbh
        terms["attention logsumexp (fp32)"] = 4 * a * s * b
    else:
        terms["softmax probabilities (a s^2 b)"] = e * a * s * s * b
        terms["causal mask (bool, s^2)"] = s * s
        terms["o_proj input (heads merged, a copy)"] = e * sbh
    terms.update({
        "mlp_norm: input (fp32 residual stream)": 4 * sbh,
        "mlp_norm: 1/rms (fp32)": 4 * s * b,
        "gate/up_proj input" + ("" if fp32 else " (2 bf16 casts)"): 4 * sbh if fp32 else 2 * 2 * sbh,
        "SwiGLU: gate, up (fused node) and their product (down_proj input)": 3 * e * s * b * F,
    })
    if not fp32 and weight_copies:
        terms["bf16 copies of the block's weights (autocast)"] = 2 * (4 * h * h + 3 * h * F)
    return terms


def head_terms(config: GPTConfig, batch: int, seq_len: int, *, dtype: str = "fp32",
               weight_copies: bool = True) -> dict[str, dict[str, int]]:
    """Bytes saved outside the blocks: {"embedding": {...}, "head": {...}}, term by term."""
    _check_shape(config, batch, seq_len, dtype)
    b, s, h, V = batch, seq_len, config.n_embd, config.vocab_size
    fp32 = dtype == "fp32"
    head = {
        "norm_f: input (fp32 residual stream)": 4 * s * b * h,
        "norm_f: 1/rms (fp32)": 4 * s * b,
        "lm_head input": (4 if fp32 else 2) * s * b * h,
        # next_token_loss: every position's log-probabilities (the last one's target is ignored, -100)
        "log-softmax of the logits (fp32)": 4 * b * s * V,
        "next-token targets (int64, targets[:, 1:] padded with -100)": 8 * b * s,
        "cross-entropy normaliser (fp32 scalar)": 4,
    }
    if not fp32 and weight_copies:
        head["bf16 copy of the (tied) lm_head weight (autocast)"] = 2 * V * h
    return {"embedding": {"token ids (int64)": 8 * b * s}, "head": head}


def expected_saved_bytes(config: GPTConfig, batch: int, seq_len: int, *, dtype: str = "fp32",
                         activation_checkpointing: bool | None = None) -> dict[str, int]:
    """Bytes saved for backward by one forward of GPT(config) with targets, per region (as measured)."""
    per_block = sum(layer_terms(config, batch, seq_len, dtype=dtype,
                                activation_checkpointing=activation_checkpointing).values())
    outside = head_terms(config, batch, seq_len, dtype=dtype)
    regions = {"embedding": sum(outside["embedding"].values())}
    regions.update({f"block {i}": per_block for i in range(config.n_layer)})
    regions["head"] = sum(outside["head"].values())
    return regions


RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none, selective (the attention scores are recomputed), full (the whole layer)."""


def korthikanti_bytes_per_layer(seq_len: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                                sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward: Korthikanti et al. (2022), table 2 (16-bit, with dropout).

    no TP: s b h (34 + 5 a s / h); TP over t: s b h (10 + 24/t + 5 a s / (h t)); TP + sequence parallelism:
    s b h (34/t + 5 a s / (h t)). The 10 s b h that plain TP keeps whole on every rank are the two norms'
    inputs (4), the two regions' inputs (4) and the two residual dropout masks (2); sequence parallelism
    splits them along the sequence. 5 a s / h is the attention scores, a s^2 per sample: the softmax output
    (2 bytes), the dropout mask (1) and the dropout output (2), split over the heads. Selective
    recomputation drops that term; full recomputation keeps only the layer's input, 2 s b h (/ t with
    sequence parallelism).
    """
    positive_ints(seq_len=seq_len, batch=batch, hidden=hidden, heads=heads, tp=tp)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a, t = seq_len, batch, hidden, heads, tp
    if recompute == "full":
        per_sbh = 2 / t if sequence_parallel else 2
    else:
        per_sbh = 34 / t if sequence_parallel else 10 + 24 / t
        if recompute == "none":
            per_sbh += 5 * a * s / (h * t)
    return s * b * h * per_sbh


def _storage(t: torch.Tensor):
    """The memory behind `t`; a DTensor (tensor parallelism) has none of its own: its local shard's."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


@contextmanager
def count_saved_bytes(exclude=(), on_save=None):
    """Count the bytes autograd saves for backward inside the block; yields {"bytes", "excluded_bytes"}.

    Every saved tensor passes through a saved_tensors_hooks pack hook. Each storage counts once (views share
    it); storages of `exclude` (parameters, buffers, inputs: they exist anyway) go to "excluded_bytes".
    Counted storages stay referenced until the block ends, so a freed address cannot be reused by a new
    tensor and then be skipped as already seen. on_save(tensor, nbytes) is called for each counted storage.
    """
    skip = {_storage(t).data_ptr() for t in exclude}
    seen, keep, counter = set(), [], {"bytes": 0, "excluded_bytes": 0}

    def pack(t: torch.Tensor):
        storage = _storage(t)
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in seen or not nbytes:
            return t
        seen.add(ptr)
        if ptr in skip:
            counter["excluded_bytes"] += nbytes
        else:
            keep.append(storage)
            counter["bytes"] += nbytes
            if on_save is not None:
                on_save(t, nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter


def measure_saved_bytes(model: GPT, idx: torch.Tensor, *, amp_dtype: torch.dtype | None = None) -> SavedBytes:
    """Run model(idx, targets=idx) in training mode and count the bytes autograd saves, per region.

    The graph is dropped before returning (no backward runs). amp_dtype: None (fp32) or torch.bfloat16.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a course_lib.core.model.GPT, got {type(model).__name__}")
    region = ["embedding"]
    by_region: dict[str, int] = defaultdict(int)
    records = []

    def record(t: torch.Tensor, nbytes: int) -> None:
        by_region[region[0]] += nbytes
        records.append({"region": region[0], "shape": tuple(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                        "bytes": nbytes})

    # The label moves on when a module *finishes*, so a checkpointed block's saved input (saved just
    # before the block runs) is attributed to that block.
    n = len(model.blocks)
    names = ["block 0"] + [f"block {i + 1}" if i + 1 < n else "head" for i in range(n)]
    modules = [model.tok_emb, *model.blocks]
    handles = [m.register_forward_hook(lambda *_, name=name: region.__setitem__(0, name))
               for m, name in zip(modules, names)]
    was_training = model.training
    model.train()
    try:
        # Parameters and buffers exist anyway: a saved reference to them costs no new memory.
        with count_saved_bytes(exclude=(*model.parameters(), *model.buffers()), on_save=record) as counter:
            with torch.autocast(idx.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                _, loss = model(idx, targets=idx)
            del loss
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    ordered = {name: by_region.get(name, 0) for name in ["embedding", *names[:n], "head"]}
    return SavedBytes(by_region=ordered, records=records, excluded_state_bytes=counter["excluded_bytes"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--attn-impl", default="sdpa", choices=("sdpa", "explicit"))
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args(argv)
    config = GPTConfig.from_preset(args.preset, attn_impl=args.attn_impl, activation_checkpointing=args.checkpointing,
                                   block_size=max(args.seq_len, PRESETS[args.preset].block_size))
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))
    measured = measure_saved_bytes(GPT(config), idx, amp_dtype=AMP_DTYPES[args.dtype])
    expected = expected_saved_bytes(config, args.batch, args.seq_len, dtype=args.dtype)
    print(f"{args.preset}, b={args.batch}, s={args.seq_len}, {args.dtype}, {args.attn_impl}, "
          f"checkpointing={args.checkpointing}")
    print(f"{'region':<10}{'measured':>14}{'formula':>14}")
    for name, value in measured.by_region.items():
        print(f"{name:<10}{value:>14,}{expected[name]:>14,}")
    print(f"{'total':<10}{measured.total:>14,}{sum(expected.values()):>14,}  ({format_bytes(measured.total)})")
    print("terms of one block:")
    for term, value in layer_terms(config, args.batch, args.seq_len, dtype=args.dtype).items():
        print(f"  {term:<52}{value:>12,}")
    k = korthikanti_bytes_per_layer(args.seq_len, args.batch, config.n_embd, config.n_head)
    print(f"Korthikanti et al. per layer (16-bit, dropout): {k:,.0f} bytes; ours ({args.dtype}, {args.attn_impl}): "
          f"{expected['block 0']:,}")


if __name__ == "__main__":
    main()

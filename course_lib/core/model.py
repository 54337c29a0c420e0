"""A small LLaMA-style GPT: RMSNorm, rotary position embeddings, SwiGLU MLP, causal attention.

The same code describes a ~100K-parameter toy and GPT-2-small (124M): only the config changes.
Nothing here knows about distributed training; parallelism is applied to a model from outside
(course_lib.data_parallel.ddp, course_lib.sharding.fsdp, ...).

Self-check (prints the logits shape and the loss of an untrained model):

    python -m course_lib.core.model
    python -m course_lib.core.model --preset small
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from course_lib.core.checks import positive_int
from course_lib.core.fused import rms_norm, rotary, swiglu

ATTENTION_IMPLS = ("sdpa", "explicit")


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the model. Every field is checked in __post_init__; errors name the field."""

    vocab_size: int = 256
    """Number of token ids (256 for the course's byte-level tokenizer)."""
    block_size: int = 128
    """Longest sequence the model accepts (context length); the rotary embedding tables hold this many
    positions."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd, and the head dimension n_embd / n_head must be even
    (rotary embeddings rotate pairs of dimensions)."""
    n_embd: int = 64
    """Width of the residual stream (hidden size)."""
    ffn_hidden: int | None = None
    """Hidden width of the SwiGLU MLP; None picks ~8/3 * n_embd rounded up to a multiple of 16."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 disables it)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Added to the mean square inside RMSNorm's square root."""
    attn_impl: str = "sdpa"
    """'sdpa' (F.scaled_dot_product_attention, fused) or 'explicit' (softmax(QK^T/sqrt(d)) + mask)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive_int(f"GPTConfig.{name}", getattr(self, name))
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by GPTConfig.n_head "
                f"({self.n_head}): each head gets n_embd / n_head dimensions"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dimension n_embd / n_head = {self.n_embd} / {self.n_head} = {self.head_dim} "
                "must be even: rotary embeddings rotate pairs of dimensions"
            )
        if self.ffn_hidden is None:
            self.ffn_hidden = 16 * math.ceil(8 * self.n_embd / 3 / 16)
        positive_int("GPTConfig.ffn_hidden", self.ffn_hidden)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("GPTConfig.norm_eps and GPTConfig.rope_theta must be positive")
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"GPTConfig.attn_impl must be one of {ATTENTION_IMPLS}, got {self.attn_impl!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named preset (see PRESETS), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


# From a toy that trains in seconds on a laptop core up to GPT-2-small (124M parameters).
PRESETS = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, ffn_hidden=128, block_size=64),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2-small": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, ffn_hidden=2048, block_size=1024),
}


class RMSNorm(nn.Module):
    """Root-mean-square normalisation: x / sqrt(mean(x^2) + eps) * weight (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 even under autocast (the mean of squares is where low precision hurts), cast
        # back to x's dtype, times the weight: course_lib.core.fused.rms_norm_reference, op by op. rms_norm
        # computes it as one autograd node with a hand-written backward (faster in eager mode, less memory).
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dimension in two halves (x1, x2) and return (-x2, x1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q and k by position-dependent angles: x * cos + rotate_half(x) * sin.

    q, k: (B, n_head, T, head_dim); cos, sin: (T, head_dim), broadcast over batch and heads.
    `rotary` computes that formula as one autograd node whose backward rotates the gradient back
    (course_lib.core.fused; rotary_reference there writes it out with the halves, op by op).
    """
    return rotary(q, k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin tables for every position up to block_size (buffers, not parameters)."""

    def __init__(self, head_dim: int, block_size: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        positions = torch.arange(block_size, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # (block_size, head_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (block_size, head_dim), matches rotate_half's halves
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)

    def forward(self, seq_len: int):
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Two parallel projections, one gated by SiLU."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)
        self.down_proj.RESIDUAL_SCALE_INIT = True  # writes into the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # swiglu(gate, up) = F.silu(gate) * up as one autograd node (course_lib.core.fused).
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def causal_attention(q, k, v, dropout_p: float = 0.0, training: bool = False):
    """softmax(q k^T / sqrt(head_dim) + causal mask) v, written out step by step.

    q, k, v: (B, n_head, T, head_dim) -> (B, n_head, T, head_dim). Position t attends to 0..t only.
    """
    T, head_dim = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)  # (B, n_head, T, T)
    causal_mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal_mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    weights = F.dropout(weights, p=dropout_p, training=training)
    return weights @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.attn_impl = config.attn_impl
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.o_proj.RESIDUAL_SCALE_INIT = True
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # The number of heads is read off the projection's output (-1), so a tensor-parallel
        # shard that holds only some heads runs this same code.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = causal_attention(q, k, v, dropout_p=dropout_p, training=self.training)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * head_dim)
        return self.resid_dropout(self.o_proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))
        return x


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 at every position t. logits (B, T, V), targets (B, T).

    Equal to F.cross_entropy(logits[:, :-1], targets[:, 1:]) over the B * (T - 1) predictions, but the
    targets are shifted instead of the logits: targets[:, 1:] padded with -100 (ignored) at the last
    position, which has no next token. The (B, T, V) logits, the largest activation of a model with a big
    vocabulary, are then used as they are, not copied (and their gradient is not padded with zeros).
    Targets already set to -100 are ignored too. The logits are cast to fp32 for the softmax.
    """
    next_tokens = F.pad(targets[:, 1:], (0, 1), value=-100)  # (B, T): position t's target is token t+1
    return F.cross_entropy(logits.flatten(0, 1).float(), next_tokens.flatten(), ignore_index=-100)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.rope = RotaryEmbedding(config.head_dim, config.block_size, config.rope_theta)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix embeds and un-embeds tokens
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """N(0, 0.02) for linear and embedding weights; residual projections scaled by 1/sqrt(2 n_layer)."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                # Each block adds two branches to the residual stream; keep its variance flat in depth.
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, RMSNorm):
            torch.nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (B, T) token ids. targets: (B, T) labels aligned with idx (usually idx itself).

        Position t predicts token t+1, so the loss compares logits[:, :-1] with targets[:, 1:]
        (next_token_loss, which shifts the targets rather than copying the logits).
        Returns (logits (B, T, vocab_size), loss or None).
        """
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(
                f"idx must be a (batch, seq_len) tensor of token ids (torch.long), "
                f"got shape {tuple(idx.shape)} and dtype {idx.dtype}"
            )
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.block_size ({self.config.block_size})")
        x = self.emb_dropout(self.tok_emb(idx))  # (B, T, n_embd)
        cos, sin = self.rope(T)
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.lm_head(self.norm_f(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
            loss = next_token_loss(logits, targets)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None):
        """Append max_new_tokens sampled tokens to idx (B, T); the context is cropped to block_size."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once each (the tied lm_head is the embedding)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6N + 12 L H Q T (PaLM appendix B; forward + backward)."""
        T = seq_len or self.config.block_size
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * T


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = GPTConfig.from_preset(args.preset)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, config.block_size))
    logits, loss = model(idx, targets=idx)
    print(f"preset {args.preset}: {model.num_params():,} parameters, "
          f"{model.flops_per_token():,} training FLOPs per token")
    print(f"logits shape: {tuple(logits.shape)}")
    print(f"loss: {loss.item():.4f} (an untrained model should be near ln(vocab_size) = "
          f"{math.log(config.vocab_size):.4f})")
    explicit = GPT(replace(config, attn_impl="explicit"))
    explicit.load_state_dict(model.state_dict())
    torch.testing.assert_close(explicit(idx)[0], logits, rtol=1e-4, atol=1e-5)
    print("explicit attention matches scaled_dot_product_attention")
    loss.backward()
    print("backward OK")


if __name__ == "__main__":
    main()

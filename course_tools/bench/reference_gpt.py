"""A plain GPT-2 written with torch's built-ins, the yardstick of the course GPT's speed (`make bench`, section vs).

nn.LayerNorm, one fused q/k/v projection, F.scaled_dot_product_attention, nn.GELU, a 4x MLP, learned positions
and a tied embedding: the GPT-2 block of nanoGPT's model.py, written here so that the benchmark needs nothing
outside the repository. Like nanoGPT it uses nn.GELU's exact (erf) form, not the tanh approximation of the
original GPT-2. The course GPT differs by design (RMSNorm, rotary positions, SwiGLU, no biases); the bench
compares achieved model FLOP/s (6N + 12LHQT per token, each model with its own N), which is fair across those
differences: it asks how well each spends the machine on the matmuls its parameters imply.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT(nn.Module):
    """GPT-2 at the given dims; forward(idx, targets) -> (logits, loss) like course_lib.core.model.GPT."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # nanoGPT's loss: every position's logits against the next token (the last one, which has none, -1)
            next_tokens = F.pad(targets[:, 1:], (0, 1), value=-1)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), next_tokens.view(-1), ignore_index=-1)
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """6N + 12 L H Q T, as GPT.flops_per_token (Q = head dim); N without the position table, as nanoGPT."""
        n = self.num_params() - self.wpe.weight.numel()
        return 6 * n + 12 * self.n_layer * self.n_head * (self.n_embd // self.n_head) * seq_len

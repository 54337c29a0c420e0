"""The reference model: config validation, component math, forward/loss, generation, FLOPs."""

import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from course_lib.core.model import (
    GPT,
    MLP,
    PRESETS,
    GPTConfig,
    RMSNorm,
    apply_rotary_pos_emb,
    causal_attention,
    next_token_loss,
    rotate_half,
)


def test_config_error_names_both_values():
    with pytest.raises(ValueError, match=r"n_embd \(100\).*n_head \(3\)"):
        GPTConfig(n_embd=100, n_head=3)


@pytest.mark.parametrize("field,value", [("n_layer", 0), ("vocab_size", -1), ("dropout", 1.5), ("attn_impl", "flash")])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{field: value})


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        GPTConfig.from_preset("huge")
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig.from_preset("tiny", n_layers=4)


def test_preset_sizes():
    assert 80_000 < GPT(PRESETS["tiny"]).num_params() < 130_000
    with torch.device("meta"):
        assert 120e6 < GPT(PRESETS["gpt2-small"]).num_params() < 130e6


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_rotate_half_example():
    assert rotate_half(torch.tensor([1, 2, 3, 4])).tolist() == [-3, -4, 1, 2]


def test_rope_preserves_norm_and_relative_position():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=32, n_head=2, block_size=16))
    cos, sin = model.rope(16)
    q = torch.randn(1, 1, 16, 16)
    k = torch.randn(1, 1, 16, 16)
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    # The same vector pair at positions (i, j) and (i+s, j+s) has the same dot product.
    same_q = q[:, :, :1].expand_as(q)
    same_k = k[:, :, :1].expand_as(k)
    qr, kr = apply_rotary_pos_emb(same_q, same_k, cos, sin)
    torch.testing.assert_close((qr[..., 5, :] * kr[..., 2, :]).sum(), (qr[..., 9, :] * kr[..., 6, :]).sum())


def test_swiglu():
    torch.manual_seed(0)
    mlp = MLP(GPTConfig())
    x = torch.randn(2, 3, 64)
    expected = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)


def test_explicit_attention_equals_sdpa_and_is_causal():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8) for _ in range(3))
    out = causal_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    v2 = v.clone()
    v2[:, :, 6:] += 100.0  # future values must not leak into earlier positions
    torch.testing.assert_close(causal_attention(q, k, v2)[:, :, :6], out[:, :, :6])


def test_model_paths_agree_and_loss_shift():
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    model = GPT(config)
    explicit = GPT(replace(config, attn_impl="explicit"))
    explicit.load_state_dict(model.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 16))
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (2, 16, config.vocab_size)
    torch.testing.assert_close(explicit(idx)[0], logits, rtol=1e-4, atol=1e-5)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), idx[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_token_loss_equals_the_loss_of_the_shifted_logits(dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7))
    targets[0, 3] = targets[2, 1] = -100  # masked positions stay ignored
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11).float(), targets[:, 1:].reshape(-1))
    (expected_grad,) = torch.autograd.grad(expected, logits)
    loss = next_token_loss(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert loss.dtype == torch.float32
    assert torch.all(grad[:, -1] == 0)  # the last position predicts nothing
    assert targets[0, 3] == -100 and targets.shape == (3, 7)  # the caller's targets are not modified


def test_tied_embeddings_and_init():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=8, n_embd=128, n_head=4)
    model = GPT(config)
    assert model.lm_head.weight is model.tok_emb.weight
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].attn.o_proj.weight.std().item() - 0.02 / 4) < 0.0005
    assert abs(model.blocks[0].mlp.down_proj.weight.std().item() - 0.02 / 4) < 0.0005
    assert torch.equal(model.norm_f.weight, torch.ones(128))


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    plain = GPT(config)
    ckpt = GPT(replace(config, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 32))
    plain(idx, idx)[1].backward()
    ckpt(idx, idx)[1].backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_forward_errors_name_the_problem():
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="torch.long"):
        model(torch.zeros(1, 8))


def test_generate_and_flops():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=70, top_k=10)
    assert out.shape == (1, 71)
    c = model.config
    assert model.flops_per_token() == 6 * model.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size


def test_self_check_cli():
    out = subprocess.run([sys.executable, "-m", "course_lib.core.model"], capture_output=True, text=True, check=True).stdout
    assert "logits shape: (2, 64, 256)" in out
    assert "loss:" in out

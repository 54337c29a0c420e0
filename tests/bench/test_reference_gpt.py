"""course_tools.bench.reference_gpt: the GPT-2 of torch built-ins that `make bench` (section vs) measures against."""

import torch
import torch.nn.functional as F

from course_tools.bench.reference_gpt import ReferenceGPT


def test_parameter_count_and_flops_follow_the_gpt2_formulas():
    V, T, L, H, C = 256, 32, 3, 4, 64
    model = ReferenceGPT(V, T, L, H, C)
    # token + position tables, per block 12 C^2 weights and 13 C biases/norm parameters, final norm; lm_head tied
    assert model.num_params() == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert model.lm_head.weight is model.wte.weight
    assert model.flops_per_token(T) == 6 * (model.num_params() - T * C) + 12 * L * H * (C // H) * T


def test_block_is_nanogpt_s_exact_gelu_mlp_and_the_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    model = ReferenceGPT(64, 16, 2, 2, 32)
    x = torch.linspace(-4, 4, 101)
    for block in model.blocks:  # the exact (erf) GELU of nn.GELU(), as in nanoGPT, between the two linears
        assert [type(m).__name__ for m in block.mlp] == ["Linear", "GELU", "Linear"]
        torch.testing.assert_close(block.mlp[1](x), F.gelu(x))
    idx = torch.randint(0, 64, (2, 16))
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (2, 16, 64)
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())

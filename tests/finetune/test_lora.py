"""LoRA: the adapted layer starts equal to its base, merges into one nn.Linear with the same outputs,
trains only its adapters, and fine-tunes a pre-trained model on new text with the base frozen.

    .venv/bin/python -m pytest -q tests/finetune/test_lora.py
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from course_lib.core.data import ByteTokenizer, synthetic_tokens
from course_lib.core.model import GPT, GPTConfig
from course_lib.finetune.lora import (
    ATTENTION_TARGETS,
    MLP_TARGETS,
    LoRALinear,
    apply_lora,
    fine_tune,
    fine_tuning_memory,
    fine_tuning_text,
    lora_parameter_count,
    lora_state_dict,
    merge_lora,
    optimizer_state_bytes,
    parameter_counts,
    split_text,
)


def randomize_b(layer: LoRALinear, seed: int = 0) -> None:
    """B starts at zero; a trained adapter has a non-zero B."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g))


@pytest.mark.parametrize("bias", [False, True])
def test_starts_equal_to_base_then_merges_to_the_same_outputs(bias):
    torch.manual_seed(0)
    base = nn.Linear(12, 20, bias=bias)
    layer = LoRALinear(copy.deepcopy(base), r=3, alpha=6)
    x = torch.randn(4, 5, 12)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)  # B = 0: exactly the base layer
    randomize_b(layer)
    expected = base(x) + 2.0 * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T  # alpha / r = 2
    torch.testing.assert_close(layer(x), expected)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    merged = layer.merge()
    assert type(merged) is nn.Linear and merged.weight.shape == (20, 12) and (merged.bias is not None) == bias
    torch.testing.assert_close(merged(x), layer(x))
    for name, tensor in layer.state_dict().items():  # merge() builds a new layer; the adapter is unchanged
        assert torch.equal(tensor, before[name]), f"merge() changed {name}"


def test_only_the_adapters_get_gradients():
    layer = LoRALinear(nn.Linear(8, 8, bias=True), r=2, alpha=4)
    randomize_b(layer)
    layer(torch.randn(3, 8)).sum().backward()
    assert layer.base.weight.grad is None and layer.base.bias.grad is None
    assert not layer.base.weight.requires_grad
    assert layer.lora_A.weight.grad is not None and layer.lora_B.weight.grad is not None
    assert layer.lora_A.weight.grad.abs().sum() > 0


def test_dropout_acts_on_the_update_only():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 16), r=4, alpha=4, dropout=0.5)
    randomize_b(layer)
    x = torch.randn(6, 16)
    torch.manual_seed(1)
    got = layer(x)
    torch.manual_seed(1)
    dropped = nn.functional.dropout(x, 0.5, training=True)
    torch.testing.assert_close(got, layer.base(x) + layer.lora_B(layer.lora_A(dropped)))
    layer.eval()
    torch.testing.assert_close(layer(x), layer.merge()(x))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(r=0, alpha=1), "positive integer"),
    (dict(r=2.0, alpha=1), "positive integer"),
    (dict(r=9, alpha=1), "exceeds min"),
    (dict(r=2, alpha=0), "alpha"),
    (dict(r=2, alpha=1, dropout=1.0), "dropout"),
])
def test_bad_hyperparameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRALinear(nn.Linear(8, 16), **kwargs)
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Embedding(4, 4), r=1, alpha=1)


def test_apply_lora_counts_the_formula_and_freezes_the_base():
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny")
    model = GPT(config)
    n_before = model.num_params()
    r = 4
    targets = ("q_proj", "v_proj", "down_proj")
    adapted = apply_lora(model, targets=targets, r=r, alpha=8)
    assert len(adapted) == config.n_layer * len(targets)
    C, F = config.n_embd, config.ffn_hidden
    formula = config.n_layer * (r * (C + C) + r * (C + C) + r * (F + C))  # r * (in + out) per adapted layer
    counts = parameter_counts(model)
    assert counts == {"trainable": formula, "frozen": n_before, "total": n_before + formula}
    assert lora_parameter_count(config, targets, r) == formula
    assert sum(t.numel() for t in lora_state_dict(model).values()) == formula
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora_state_dict(model))


def test_apply_then_merge_keeps_the_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    idx = torch.randint(0, 256, (2, 32))
    reference, _ = model(idx)
    apply_lora(model, targets=ATTENTION_TARGETS + MLP_TARGETS, r=4, alpha=8)
    torch.testing.assert_close(model(idx)[0], reference, rtol=0, atol=0)
    for i, module in enumerate(m for m in model.modules() if isinstance(m, LoRALinear)):
        randomize_b(module, seed=i)
        module.lora_B.weight.data *= 0.01
    adapted, _ = model(idx)
    assert not torch.allclose(adapted, reference)
    merged_names = merge_lora(model)
    assert len(merged_names) == 2 * 7 and not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(idx)[0], adapted)


def test_bad_targets_are_named():
    model = GPT(GPTConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=r"'qproj' matches no module.*q_proj"):
        apply_lora(model, targets=("qproj",))
    with pytest.raises(ValueError, match="not an nn.Linear"):
        apply_lora(model, targets=("attn",))
    with pytest.raises(ValueError, match="non-empty"):
        apply_lora(model, targets=())
    assert all(p.requires_grad for p in model.parameters()), "a refused apply_lora must not freeze the model"
    apply_lora(model, targets="q_proj", r=2, alpha=2)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, targets="v_proj")
    with pytest.raises(ValueError, match="unknown LoRA target"):
        lora_parameter_count(GPTConfig.from_preset("tiny"), ("lm_head",))


def test_memory_estimate_and_measured_optimizer_state():
    full = fine_tuning_memory(1000, 1000)
    lora = fine_tuning_memory(1000 + 10, 10, weight_bytes=2)
    assert full == {"weights": 4000, "gradients": 4000, "optimizer_states": 8000, "total": 16000}
    assert lora == {"weights": 2000 + 40, "gradients": 40, "optimizer_states": 80, "total": 2160}
    model = GPT(GPTConfig.from_preset("tiny"))
    apply_lora(model, r=2, alpha=4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    idx = torch.randint(0, 256, (2, 16))
    model(idx, targets=idx)[1].backward()
    optimizer.step()
    n_trainable = parameter_counts(model)["trainable"]
    # exp_avg + exp_avg_sq in fp32, plus one scalar `step` tensor per parameter tensor.
    steps = sum(state["step"].numel() * state["step"].element_size() for state in optimizer.state.values())
    assert optimizer_state_bytes(optimizer) == 8 * n_trainable + steps


def test_fine_tuning_text_is_code_split_at_a_file():
    text = fine_tuning_text()
    assert text.startswith("# file: ") and "def apply_lora(" in text and "class GPT(nn.Module)" in text
    train, val = split_text(text)
    assert train + val == text and val.startswith("# file: ")
    assert 0.05 < len(val) / len(text) < 0.2
    with pytest.raises(ValueError, match="val_fraction"):
        split_text(text, 1.0)


def test_lora_fine_tune_lowers_the_loss_with_the_base_frozen(one_thread):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=32)
    base = GPT(config)
    tokens = synthetic_tokens(20_000, seed=1, kind="cycle")
    held_out = synthetic_tokens(2_000, seed=1, kind="cycle")
    model = copy.deepcopy(base)
    apply_lora(model, targets=ATTENTION_TARGETS + MLP_TARGETS, r=4, alpha=8)
    result = fine_tune(model, tokens, steps=40, lr=1e-2, batch_size=8, block_size=32,
                       eval_sets={"held out": held_out}, eval_every=20)
    (_, start), *_, (last_step, end) = result["evals"]["held out"]
    assert last_step == 40 and len(result["evals"]["held out"]) == 3
    assert end < start - 0.1, f"LoRA fine-tuning should lower the held-out loss: {start:.3f} -> {end:.3f}"
    frozen = {name.replace(".base.", "."): p for name, p in model.named_parameters() if not p.requires_grad}
    for name, param in base.named_parameters():
        assert torch.equal(frozen[name], param), f"{name} changed although it is frozen"
    assert result["optimizer_state_bytes"] > 8 * parameter_counts(model)["trainable"] - 1


def test_same_outputs_as_peft():
    """peft's LoRA (if installed) with the same A and B computes the same layer and the same merge."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8,
                                                                       target_modules=["q_proj", "v_proj"]))
    apply_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8)
    peft_layers = {name.removeprefix("base_model.model."): m for name, m in theirs.named_modules()
                   if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    for name, mine in ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)):
        randomize_b(mine, seed=len(name))
        with torch.no_grad():
            peft_layers[name].lora_A["default"].weight.copy_(mine.lora_A.weight)
            peft_layers[name].lora_B["default"].weight.copy_(mine.lora_B.weight)
    idx = torch.tensor([ByteTokenizer().encode("def apply_lora(model, targets):")])
    torch.testing.assert_close(model(idx)[0], theirs(idx)[0])
    assert parameter_counts(model)["trainable"] == sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    merge_lora(model)
    torch.testing.assert_close(model(idx)[0], theirs.merge_and_unload()(idx)[0])

"""AdamW parameter groups and the warmup + cosine learning-rate schedule."""

import math

import pytest
import torch
import torch.nn as nn

from course_lib.core.model import GPT, GPTConfig, RMSNorm
from course_lib.core.optim import configure_optimizer, get_lr, make_scheduler, param_groups

SCHEDULE = dict(max_lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)


class TiedWithBiases(nn.Module):
    """Biases, a LayerNorm and a weight shared by two layers: every case the grouping must handle."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 6, bias=True)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight


def _ids(params):
    return [id(p) for p in params]


@pytest.mark.parametrize("make_model", [lambda: GPT(GPTConfig.from_preset("tiny")), TiedWithBiases])
def test_every_parameter_in_exactly_one_group(make_model):
    model = make_model()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    grouped = _ids(decay["params"]) + _ids(no_decay["params"])
    assert len(grouped) == len(set(grouped)), "a parameter appears twice"
    assert set(grouped) == {id(p) for p in model.parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])


def test_norms_and_biases_are_not_decayed_and_tied_weight_counted_once():
    model = TiedWithBiases()
    decay, no_decay = (set(_ids(g["params"])) for g in param_groups(model, 0.1))
    assert {id(model.hidden.bias), id(model.norm.weight), id(model.norm.bias)} <= no_decay
    assert {id(model.hidden.weight), id(model.emb.weight)} <= decay
    gpt = GPT(GPTConfig.from_preset("tiny"))
    groups = param_groups(gpt, 0.1)
    norm_weights = {id(m.weight) for m in gpt.modules() if isinstance(m, RMSNorm)}
    assert norm_weights == set(_ids(groups[1]["params"]))
    assert _ids(groups[0]["params"]).count(id(gpt.tok_emb.weight)) == 1  # lm_head.weight is the same tensor
    assert sum(p.numel() for g in groups for p in g["params"]) == gpt.num_params()


def test_decay_acts_only_on_the_decay_group():
    # With zero gradients AdamW's update is pure decay: p <- p * (1 - lr * weight_decay).
    model = TiedWithBiases()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = configure_optimizer(model, lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if p.dim() >= 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, msg=f"parameter {name}")


def test_configure_optimizer_rejects_bad_values():
    with pytest.raises(ValueError, match="lr"):
        configure_optimizer(TiedWithBiases(), lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        configure_optimizer(TiedWithBiases(), lr=1e-3, weight_decay=-1)


def test_get_lr_at_landmarks():
    max_lr, min_lr, warmup, max_steps = (SCHEDULE[k] for k in ("max_lr", "min_lr", "warmup_steps", "max_steps"))
    assert get_lr(0, **SCHEDULE) == pytest.approx(max_lr / warmup)
    assert get_lr(warmup - 1, **SCHEDULE) == pytest.approx(max_lr)  # end of warmup
    assert get_lr(warmup, **SCHEDULE) == pytest.approx(max_lr)  # start of the cosine
    assert get_lr((warmup + max_steps) // 2, **SCHEDULE) == pytest.approx((max_lr + min_lr) / 2)
    assert get_lr(max_steps, **SCHEDULE) == pytest.approx(min_lr)
    assert get_lr(max_steps + 500, **SCHEDULE) == min_lr
    lrs = [get_lr(s, **SCHEDULE) for s in range(max_steps + 1)]
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup])), "warmup must increase"
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:])), "decay must not increase"


def test_get_lr_rejects_inconsistent_schedules():
    with pytest.raises(ValueError, match="warmup_steps"):
        get_lr(0, max_lr=1.0, min_lr=0.1, warmup_steps=20, max_steps=10)
    with pytest.raises(ValueError, match="min_lr"):
        get_lr(0, max_lr=1.0, min_lr=2.0, warmup_steps=1, max_steps=10)


def test_scheduler_follows_get_lr_and_resumes_from_state_dict():
    model = TiedWithBiases()
    optimizer = configure_optimizer(model, lr=SCHEDULE["max_lr"])
    scheduler = make_scheduler(optimizer, **SCHEDULE)
    for step in range(30):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(get_lr(step, **SCHEDULE), rel=1e-12)
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    fresh_optimizer = configure_optimizer(TiedWithBiases(), lr=SCHEDULE["max_lr"])
    fresh = make_scheduler(fresh_optimizer, **SCHEDULE)
    fresh.load_state_dict(state)
    fresh_optimizer.step()
    fresh.step()
    optimizer.step()
    scheduler.step()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert math.isclose(optimizer.param_groups[0]["lr"], get_lr(31, **SCHEDULE), rel_tol=1e-12)


def test_scheduler_requires_matching_base_lr():
    optimizer = configure_optimizer(TiedWithBiases(), lr=1e-2)
    with pytest.raises(ValueError, match="max_lr"):
        make_scheduler(optimizer, **SCHEDULE)

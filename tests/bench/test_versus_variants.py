"""The variants of the course GPT that `make bench` (section vs) times next to it: the formulas swapped in are
the ones named, only while a step runs."""

import pytest
import torch
import torch.nn.functional as F

import course_lib.core.model as model_module
from course_tools.bench.compute import (
    OP_BY_OP,
    WITHOUT_ROPE_AND_RMSNORM,
    _with_formulas,
    layer_norm_kernels,
    no_rotation,
)
from course_lib.core.fused import rms_norm, rotary, swiglu
from course_lib.core.model import GPT, GPTConfig


def _loss(model, idx):
    return model(idx, targets=idx)[1]


def test_formulas_are_swapped_during_the_step_and_restored_after_it_even_when_it_fails():
    seen = {}

    def step():
        seen.update(rms_norm=model_module.rms_norm, rotary=model_module.rotary, swiglu=model_module.swiglu)
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        _with_formulas(step, **WITHOUT_ROPE_AND_RMSNORM)()
    assert seen == {"rms_norm": layer_norm_kernels, "rotary": no_rotation, "swiglu": swiglu}
    assert (model_module.rms_norm, model_module.rotary, model_module.swiglu) == (rms_norm, rotary, swiglu)


def test_op_by_op_variant_trains_the_same_model_and_the_cost_breakdown_variant_does_not():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, formulas in (("fused", {}), ("op_by_op", OP_BY_OP), ("ablated", WITHOUT_ROPE_AND_RMSNORM)):
        _with_formulas(lambda name=name: losses.__setitem__(name, _loss(model, idx)), **formulas)()
    torch.testing.assert_close(losses["op_by_op"], losses["fused"])
    # LayerNorm subtracts the mean and no rotation drops the positions: a different function, timed only.
    assert not torch.allclose(losses["ablated"], losses["fused"])


def test_layer_norm_kernels_and_no_rotation():
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    torch.testing.assert_close(layer_norm_kernels(x, w, 1e-5), F.layer_norm(x, (8,), w, None, 1e-5))
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    out_q, out_k = no_rotation(q, k, torch.ones(3, 4), torch.zeros(3, 4))
    assert out_q is q and out_k is k

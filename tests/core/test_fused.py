"""course_lib.core.fused: the fused RMSNorm and rotary nodes against their op-by-op references."""

import pytest
import torch

from course_lib.core.fused import (
    rms_norm,
    rms_norm_reference,
    rotary,
    rotary_reference,
    swiglu,
    swiglu_reference,
)
from course_lib.core.model import (
    GPT,
    GPTConfig,
    RotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)


def _inputs(shape, dtype, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


def test_rms_norm_gradcheck():
    x, w = _inputs((3, 5, 16), torch.float64), _inputs((16,), torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w))
    # The hand-written backward is not itself differentiable: a second backward fails instead of being wrong.
    (gx,) = torch.autograd.grad(rms_norm(x, w, 1e-5).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        gx.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_rms_norm_equals_reference_forward_and_backward(dtype, eps):
    x1, w1 = _inputs((4, 7, 32), dtype), _inputs((32,), torch.float32, seed=1)
    x2, w2 = x1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    grad = _inputs((4, 7, 32), torch.float32, seed=2, requires_grad=False)
    y1, y2 = rms_norm(x1, w1, eps), rms_norm_reference(x2, w2, eps)
    assert y1.dtype == y2.dtype
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(y1, y2, **tol)
    y1.backward(grad.to(y1.dtype))
    y2.backward(grad.to(y2.dtype))
    assert x1.grad.dtype == dtype and w1.grad.dtype == torch.float32
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    torch.testing.assert_close(w1.grad, w2.grad, **(dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}))


def test_rms_norm_frozen_weight_gets_no_gradient():
    x, w = _inputs((2, 3, 8), torch.float32), _inputs((8,), torch.float32, seed=1, requires_grad=False)
    rms_norm(x, w, 1e-5).sum().backward()
    assert w.grad is None and x.grad is not None


def test_rms_norm_saves_input_and_one_number_per_vector():
    x, w = _inputs((2, 3, 8), torch.float32), _inputs((8,), torch.float32, seed=1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, w, 1e-5)
    assert sorted(tuple(t.shape) for t in saved) == [(2, 3, 1), (2, 3, 8), (8,)]


def test_rotary_gradcheck_and_reference():
    cos, sin = (t.double() for t in RotaryEmbedding(16, block_size=8, theta=100.0)(6))
    x = _inputs((2, 3, 6, 16), torch.float64)
    y = _inputs((2, 3, 6, 16), torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda x, y: rotary(x, y, cos, sin), (x, y))
    q_rotated, k_rotated = rotary(x, y, cos, sin)
    q_reference, k_reference = rotary_reference(x, y, cos, sin)
    torch.testing.assert_close(q_rotated, q_reference)
    torch.testing.assert_close(k_rotated, k_reference)
    torch.testing.assert_close(q_reference, x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_backward_equals_reference_on_strided_input(dtype):
    # q as the model makes it: a transposed view of a (B, T, H, D) projection output.
    cos, sin = RotaryEmbedding(8, block_size=16)(5)
    base = _inputs((2, 5, 3, 8), dtype)
    q1 = base.detach().clone().requires_grad_()
    q2 = base.detach().clone().requires_grad_()
    y1, _ = rotary(q1.transpose(1, 2), q1.transpose(1, 2), cos, sin)
    y2, _ = rotary_reference(q2.transpose(1, 2), q2.transpose(1, 2), cos, sin)
    assert y1.dtype == y2.dtype and y1.shape == y2.shape
    torch.testing.assert_close(y1, y2)
    grad = _inputs(y1.shape, torch.float32, seed=3, requires_grad=False).to(y1.dtype)
    y1.backward(grad)
    y2.backward(grad)
    assert q1.grad.dtype == dtype
    # bf16: the reference rounds the gradient to bf16 between its steps, the fused node once at the end.
    torch.testing.assert_close(q1.grad, q2.grad, **(dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}))


def test_rotary_gradient_of_one_output_only():
    cos, sin = RotaryEmbedding(8, block_size=16)(5)
    q, k = _inputs((2, 5, 8), torch.float32), _inputs((2, 5, 8), torch.float32, seed=1)
    rotary(q, k, cos, sin)[0].sum().backward()
    q_reference = q.detach().clone().requires_grad_()
    rotary_reference(q_reference, k.detach(), cos, sin)[0].sum().backward()
    torch.testing.assert_close(q.grad, q_reference.grad)
    assert k.grad is None


def test_rotary_saves_no_activation():
    cos, sin = RotaryEmbedding(8, block_size=16)(5)
    x = _inputs((2, 3, 5, 8), torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q, k = apply_rotary_pos_emb(x, x, cos, sin)
    assert all(t.data_ptr() in (cos.data_ptr(), sin.data_ptr()) for t in saved) and saved


def test_swiglu_gradcheck_and_saved_tensors():
    gate, up = _inputs((3, 4, 10), torch.float64), _inputs((3, 4, 10), torch.float64, seed=1)
    assert torch.autograd.gradcheck(swiglu, (gate, up))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate, up)
    assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_reference_forward_and_backward(dtype):
    gate1, up1 = _inputs((4, 6, 24), dtype), _inputs((4, 6, 24), dtype, seed=1)
    gate2, up2 = (t.detach().clone().requires_grad_() for t in (gate1, up1))
    grad = _inputs((4, 6, 24), dtype, seed=2, requires_grad=False)
    y1, y2 = swiglu(gate1, up1), swiglu_reference(gate2, up2)
    assert y1.dtype == y2.dtype == dtype
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(y1, y2, **tol)
    y1.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(gate1.grad, gate2.grad, **tol)
    torch.testing.assert_close(up1.grad, up2.grad, **tol)


def test_swiglu_gradient_for_gate_only():
    gate, up = _inputs((2, 5), torch.float32), _inputs((2, 5), torch.float32, seed=1, requires_grad=False)
    swiglu(gate, up).sum().backward()
    torch.testing.assert_close(gate.grad, torch.autograd.grad(swiglu_reference(gate, up).sum(), gate)[0])


def test_model_with_fused_nodes_equals_model_with_references(monkeypatch):
    """The whole GPT, forward and every parameter's gradient, with the fused nodes and with the references."""
    import course_lib.core.model as model_module

    config = GPTConfig.from_preset("tiny")
    idx = torch.randint(0, config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    fused = GPT(config)
    _, loss_fused = fused(idx, targets=idx)
    loss_fused.backward()
    calls = {"rms_norm": 0, "rotary": 0, "swiglu": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(model_module, "rms_norm", counted("rms_norm", rms_norm_reference))
    monkeypatch.setattr(model_module, "rotary", counted("rotary", rotary_reference))
    monkeypatch.setattr(model_module, "swiglu", counted("swiglu", swiglu_reference))
    torch.manual_seed(0)
    reference = GPT(config)
    _, loss_reference = reference(idx, targets=idx)
    loss_reference.backward()
    n = config.n_layer
    assert calls == {"rms_norm": 2 * n + 1, "rotary": n, "swiglu": n}  # the references did run
    torch.testing.assert_close(loss_fused, loss_reference)
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")

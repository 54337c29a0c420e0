"""RMSNorm, rotary embeddings and SwiGLU as single autograd nodes with hand-written backward passes.

Written op by op (`rms_norm_reference`, `rotary_reference`, `swiglu_reference`), each formula is two to
eight tensor operations, and autograd records every one: each writes a new tensor the size of the
activations in forward, and again in backward, and several keep a copy for backward. On a GPU under
torch.compile such chains are fused into one kernel anyway; in eager mode on a CPU, where a training step is
short of cache and memory bandwidth, every full-size tensor written costs time. `rms_norm`, `rotary` and
`swiglu` compute the same formulas inside one `torch.autograd.Function` each: the forward writes its output
with in-place steps, and the backward is the derivative written out, so autograd sees one node and keeps
only what that backward reads.

- RMSNorm, y = x * r * g with r = 1 / sqrt(mean(x^2) + eps) per vector. Saved: the input x and r (one number
  per vector); the normalised input n = x * r is recomputed in backward instead of stored. With u = dy * g,
  dg = sum over vectors of dy * n and dx = r * (u - n * mean(u * n)).
- Rotary embedding, y = x * cos + rotate_half(x) * sin. It is a rotation of each pair (x_j, x_{j+d/2}), so
  its backward is the rotation by the opposite angle: dx = dy * cos - rotate_half(dy * sin). Saved: the
  cos/sin tables only (buffers of the model, no activation memory). Queries and keys share one node.
- SwiGLU, y = silu(gate) * up. Saved: gate and up; silu(gate) is recomputed in backward.

`make bench` (section vs) times the course GPT with these against a GPT-2 of torch built-ins;
tests/core/test_fused.py checks each against its reference with torch.autograd.gradcheck, and a whole GPT
with the fused nodes against one with the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# ------------------------------------------------------------------------------------------------ RMSNorm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm op by op: the mean of squares in fp32 (even for 16-bit x), cast back to x's dtype, times weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x if x.dtype in (torch.float32, torch.float64) else x.float()
        # 1 / rms per vector: ||x||^2 / d = mean(x^2), without a full-size x^2 tensor.
        rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        normed = (x32 * rstd).to(x.dtype)
        # In place unless weight has a wider dtype than x (then the product takes weight's, as in the reference).
        return normed.mul_(weight) if weight.dtype == normed.dtype else normed * weight

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        x, grad, weight = x.to(acc), grad.to(acc), weight.to(acc)
        # With n = x * rstd and u = grad * weight:  dweight = sum over vectors of grad * n,
        # dx = rstd * (u - n * mean(u * n)) = rstd * u - x * rstd^2 * mean(u * n).
        buffer = (grad * x).mul_(rstd)  # grad * n; the one full-size tensor, reused in place below
        grad_weight = buffer.sum(dim=tuple(range(grad.dim() - 1))) if ctx.needs_input_grad[1] else None
        mean_un = buffer.mul_(weight).mean(-1, keepdim=True)  # buffer is u * n now
        grad_x = None
        if ctx.needs_input_grad[0]:  # written over buffer, which is no longer needed
            grad_x = buffer.copy_(grad).mul_(weight).mul_(rstd).addcmul_(x, rstd.square().mul_(mean_un), value=-1.0)
            grad_x = grad_x.to(ctx.x_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference(x, weight, eps)` as one autograd node (saves x and 1/rms; see the module docstring)."""
    return _RMSNorm.apply(x, weight, eps)


# ------------------------------------------------------------------------------------------------- rotary


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x * cos + rotate_half(x) * sin for x = q and x = k, with rotate_half(x1, x2) = (-x2, x1) over the halves
    of the last dimension."""
    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool) -> torch.Tensor:
    """Pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); inverse=True rotates by the opposite angle
    (the transpose: (x1 cos + x2 sin, x2 cos - x1 sin)). One output tensor, written in place half by half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    sign = 1.0 if inverse else -1.0
    out[..., :half].addcmul_(x2, sin[..., half:] if inverse else sin[..., :half], value=sign)
    out[..., half:].addcmul_(x1, sin[..., :half] if inverse else sin[..., half:], value=-sign)
    return out


class _Rotary(torch.autograd.Function):
    """Queries and keys in one node: one Python call forward and one backward instead of two each."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)  # an output nothing used arrives as None, not as zeros
        ctx.dtypes = q.dtype, k.dtype
        return _rotate(q, cos, sin, inverse=False), _rotate(k, cos, sin, inverse=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grads = []
        for grad, dtype, needed in zip((grad_q, grad_k), ctx.dtypes, ctx.needs_input_grad[:2]):
            grads.append(_rotate(grad, cos, sin, inverse=True).to(dtype) if needed and grad is not None else None)
        return grads[0], grads[1], None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rotary_reference(q, k, cos, sin)` as one autograd node that saves only the tables.

    q, k: (..., T, head_dim); cos, sin: (T, head_dim), broadcast over the leading dimensions.
    """
    return _Rotary.apply(q, k, cos, sin)


# ------------------------------------------------------------------------------------------------- SwiGLU


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, op by op: autograd keeps gate, silu(gate) and up for backward."""
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = F.silu(gate).mul_(grad)  # silu(gate) recomputed rather than kept from forward
        if ctx.needs_input_grad[0]:
            # d silu(g)/dg = sigmoid(g) (1 + g (1 - sigmoid(g))), times grad * up, computed in place by one kernel.
            grad_gate = grad * up
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`swiglu_reference(gate, up)` as one autograd node that keeps only gate and up."""
    return _SwiGLU.apply(gate, up)

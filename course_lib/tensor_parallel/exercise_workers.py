"""Rank workers that grade the tensor-parallel exercise (Session E, notebook 02b): the learner's f and g.

    ranks = launch(check_megatron_regions, 2, args=(spawnable(megatron_f_and_g),))

Every rank computes a two-layer MLP, y = g(relu(f(x) A_r^T) B_r^T), with its slice of the weights: rows of A
(column-parallel), columns of B (row-parallel); megatron_regions_reference computes the whole MLP in one
process. The worker records every all-reduce: its size and whether it ran in forward or in backward.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from course_lib.tensor_parallel.tp_layers import copy_to_parallel_region, reduce_from_parallel_region
from course_lib.parity import seeded_gpt

HIDDEN, WIDTH, ROWS = 6, 16, 3
"""x is (ROWS, HIDDEN); A is (WIDTH, HIDDEN), B is (HIDDEN, WIDTH): WIDTH splits over 1, 2, 4, 8 ranks."""


def megatron_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 5)
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64)
            for name, shape in (("x", (ROWS, HIDDEN)), ("A", (WIDTH, HIDDEN)), ("B", (HIDDEN, WIDTH)),
                                ("upstream", (ROWS, HIDDEN)))}


def megatron_regions_reference(seed: int = 0) -> dict[str, torch.Tensor]:
    """One process, the whole MLP: output and the gradients of x, A and B for loss = sum(y * upstream)."""
    t = {k: v.clone().requires_grad_(k != "upstream") for k, v in megatron_inputs(seed).items()}
    y = torch.relu(t["x"] @ t["A"].T) @ t["B"].T
    (y * t["upstream"]).sum().backward()
    return {"y": y.detach(), "x_grad": t["x"].grad, "A_grad": t["A"].grad, "B_grad": t["B"].grad}


def check_megatron_regions(make_fn, *, seed: int = 0) -> dict:
    """Worker: f, g = make_fn(); this rank's slice of the MLP between them; forward, backward, what was sent."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    width = WIDTH // world_size
    full = megatron_inputs(seed)
    x = full["x"].clone().requires_grad_()
    a = full["A"][rank * width:(rank + 1) * width].clone().requires_grad_()
    b = full["B"][:, rank * width:(rank + 1) * width].clone().requires_grad_()
    calls = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        calls.append({"numel": tensor.numel(), "in_backward": torch._C._current_graph_task_id() != -1})
        return real(tensor, *args, **kwargs)

    result = {"rank": rank, "world_size": world_size, "error": None, "width": width}
    with mock.patch.object(dist, "all_reduce", recording):
        try:
            f, g = make_fn()
            y = g(torch.relu(f(x) @ a.T) @ b.T)
            (y * full["upstream"]).sum().backward()
            result.update(y=y.detach().clone(), x_grad=x.grad.clone(), A_grad=a.grad.clone(), B_grad=b.grad.clone(),
                          x_unchanged=torch.equal(x.detach(), full["x"]))
        except Exception as err:  # noqa: BLE001 (reported to the test cell)
            result["error"] = f"{type(err).__name__}: {err}"
    result["calls"] = calls
    return result


# ---------------------------------------------------------------------------------------------- a whole block

BLOCK_ROWS, BLOCK_SEQ = 2, 8
TP_LINEARS = {"attn.q_proj": "column", "attn.k_proj": "column", "attn.v_proj": "column", "attn.o_proj": "row",
              "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
"""How each linear layer of a transformer block is split: column-parallel (rows of weight) or row-parallel."""


def tp_block(seed: int = 0):
    """The first transformer block of the tiny GPT (n_embd 64, 4 heads, ffn 128) and its rotary tables."""
    model = seeded_gpt(seed + 13, "tiny")
    cos, sin = model.rope(BLOCK_SEQ)
    return model.blocks[0], cos, sin


def tp_block_input(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 17)
    block, _, _ = tp_block(seed)
    h = block.attn.q_proj.in_features
    return (torch.randn(BLOCK_ROWS, BLOCK_SEQ, h, generator=generator),
            torch.randn(BLOCK_ROWS, BLOCK_SEQ, h, generator=generator))


def tp_block_reference(seed: int = 0) -> dict:
    """One process, the whole block: output, input gradient and every parameter's gradient."""
    block, cos, sin = tp_block(seed)
    x, upstream = tp_block_input(seed)
    x.requires_grad_(True)
    y = block(x, cos, sin)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "grads": {n: p.grad.clone() for n, p in block.named_parameters()}}


def check_tensor_parallel_block(parallelize_fn, *, seed: int = 0) -> dict:
    """Worker: parallelize_fn(block, f, g) with course_lib's f and g, then forward and backward of this rank's copy.

    Returns the output, the input gradient, every parameter's gradient and shape by name, and every all-reduce
    (size, forward or backward).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    block, cos, sin = tp_block(seed)
    x, upstream = tp_block_input(seed)
    x.requires_grad_(True)
    calls = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        calls.append({"numel": tensor.numel(), "in_backward": torch._C._current_graph_task_id() != -1})
        return real(tensor, *args, **kwargs)

    result = {"rank": rank, "world_size": world_size, "error": None}
    with mock.patch.object(dist, "all_reduce", recording):
        try:
            parallelize_fn(block, copy_to_parallel_region, reduce_from_parallel_region)
            y = block(x, cos, sin)
            (y * upstream).sum().backward()
            result.update(y=y.detach().clone(), x_grad=x.grad.clone(),
                          grads={n: None if p.grad is None else p.grad.clone() for n, p in block.named_parameters()},
                          shapes={n: tuple(p.shape) for n, p in block.named_parameters()})
        except Exception as err:  # noqa: BLE001 (reported to the test cell)
            result["error"] = f"{type(err).__name__}: {err}"
    result["calls"] = calls
    return result

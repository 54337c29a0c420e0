"""Rank workers for tensor parallelism: the sharded model trained next to one process holding the whole model.

Tensor parallelism splits the *model*, not the batch: every rank of a tensor-parallel group sees the same
batch, holds 1/t of each block's weights, and must produce exactly the logits, loss, gradients and updated
weights of one process.

    from course_lib.runtime.launch import launch
    from course_lib.tensor_parallel.workers import compare_with_reference, reference_run, tp_checks
    reference = reference_run(steps=3)                                  # one process, whole model
    ranks = launch(tp_checks, world_size=2)                             # scratch + DTensor variants, one job
    compare_with_reference(ranks[0]["scratch"], reference)              # raises unless equal
    ranks = launch(tp_checks, world_size=4, kwargs=dict(runs=(("scratch tp2", dict(tp=2)),
                                                              ("scratch tp4", dict(tp=4)))))

With tp < world size the ranks form world_size / tp groups of consecutive ranks (as GPUs of one node), each
group training its own sharded copy of the same model on the same batch.

Rank workers that grade the tensor-parallel exercise (Session E, notebook 02b): the learner's f and g.

    ranks = launch(check_megatron_regions, 2, args=(spawnable(megatron_f_and_g),))

Every rank computes a two-layer MLP, y = g(relu(f(x) A_r^T) B_r^T), with its slice of the weights: rows of A
(column-parallel), columns of B (row-parallel); megatron_regions_reference computes the whole MLP in one
process. The worker records every all-reduce: its size and whether it ran in forward or in backward.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from unittest import mock

import torch
import torch.distributed as dist

from course_lib.core.steps import train_step
from course_lib.memory.activations import count_saved_bytes
from course_lib.parity import global_batches, seeded_gpt
from course_lib.runtime.env import get_dist_info
from course_lib.tensor_parallel.dtensor import CollectiveCounter, apply_dtensor_tp, gather_full_dtensor, make_tp_mesh
from course_lib.tensor_parallel.tp_layers import (
    apply_tensor_parallel,
    gather_full,
    replicated_parameter_names,
    tp_allreduce_bytes_per_layer,
)
from course_lib.tensor_parallel.tp_layers import copy_to_parallel_region, reduce_from_parallel_region

DEFAULT_RUNS = (
    ("scratch", dict(implementation="scratch")),
    ("dtensor", dict(implementation="dtensor")),
    ("dtensor, f per projection", dict(implementation="dtensor", fuse_region_input=False)),
    ("dtensor + sequence parallel", dict(implementation="dtensor", sequence_parallel=True)),
)


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward (each storage once; parameters excluded)."""
    with count_saved_bytes(exclude=model.parameters()) as counter:
        model(tokens, targets=tokens)
    return counter["bytes"]


def _train(model, optimizer, batches, gather, measure=None) -> dict:
    """Shared loop: first-step logits/loss/grads (full size), per-step losses, final parameters (full size).

    measure: a context manager factory wrapped around the first step's forward and backward (communication).
    """
    out = {"losses": []}
    device = next(model.parameters()).device

    def forward_backward(micro_batches, first: bool):
        (tokens,) = micro_batches
        with measure() if (measure and first) else nullcontext():
            logits, loss = model(tokens, targets=tokens)
            loss.backward()
        if first:
            out["logits"], out["loss"] = logits.detach().clone(), loss.item()
        return loss.detach()

    for step, tokens in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        first = step == 0
        stats = train_step(model, [tokens.to(device)], optimizer,
                           forward_backward=lambda micro_batches: forward_backward(micro_batches, first),
                           after_backward=(lambda: out.update(grads=gather(model, grads=True))) if first else None,
                           grad_norm=False)
        out["losses"].append(stats["loss"])
    out["params"] = gather(model)
    out["lr"] = optimizer.param_groups[0]["lr"]
    return _to_cpu(out)


def _to_cpu(value):
    """Results leave the rank on the CPU, so a GPU job compares with a CPU reference in the caller."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def reference_run(steps: int = 3, preset: str = "tiny", batch: int = 4, seq_len: int = 32, seed: int = 0,
                  lr: float = 1e-3) -> dict:
    """One process, the whole model: the values every tensor-parallel rank must reproduce."""
    model = seeded_gpt(seed, preset)

    def gather(m, grads=False):
        return {n: (p.grad if grads else p.detach()).clone() for n, p in m.named_parameters()}
    batches = global_batches(steps, batch, seq_len, seed)
    activations = saved_activation_bytes(model, batches[0])
    out = _train(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1), batches, gather)
    out.update(saved_activation_bytes=activations, params_total=sum(p.numel() for p in model.parameters()))
    return out


def compare_with_reference(result: dict, reference: dict, where: str = "") -> dict[str, float]:
    """Assert that one rank's result equals one process; return the largest absolute differences.

    logits, loss: torch.testing.assert_close with fp32 defaults. Gradients: the fp32 default atol (1e-5) taken
    relative to each tensor's largest entry — gradients here are ~1e-4, so an absolute 1e-5 would accept
    almost anything. Parameters after AdamW steps: atol = lr / 10. Adam divides by sqrt(v) + eps (1e-8): a
    gradient entry that is itself ~1e-8, what is left of a sum whose terms cancel, is mostly rounding, and
    Adam turns its rounding difference into an update difference of up to a few percent of lr. A wrong
    gradient moves most entries by ~lr, far outside the tolerance.
    """
    where = f"{where}: " if where else ""
    torch.testing.assert_close(result["logits"], reference["logits"], msg=f"{where}logits")
    torch.testing.assert_close(result["loss"], reference["loss"], msg=f"{where}loss")
    if result["grads"].keys() != reference["grads"].keys():
        differing = sorted(result["grads"].keys() ^ reference["grads"].keys())
        raise AssertionError(f"{where}parameter names differ: {differing}")
    for name, want in reference["grads"].items():
        torch.testing.assert_close(result["grads"][name], want, rtol=1.3e-6, atol=1e-5 * want.abs().max().item(),
                                   msg=f"{where}gradient of {name}")
    for name, want in reference["params"].items():
        torch.testing.assert_close(result["params"][name], want, rtol=1.3e-6, atol=reference["lr"] / 10,
                                   msg=f"{where}{name} after {len(reference['losses'])} steps")

    def largest(key):
        return max((result[key][n] - v).abs().max().item() for n, v in reference[key].items())
    return {"logits": (result["logits"] - reference["logits"]).abs().max().item(),
            "loss": abs(result["loss"] - reference["loss"]), "grads": largest("grads"), "params": largest("params")}


def tensor_parallel_group(tp: int | None = None):
    """This rank's group of tp consecutive ranks (None = the whole world). Every rank must call it."""
    world_size = dist.get_world_size()
    tp = tp or world_size
    if world_size % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the world size {world_size}")
    if tp == world_size:
        return None
    group, _ = dist.new_subgroups(group_size=tp)
    return group


def scratch_tp_run(steps: int = 3, preset: str = "tiny", batch: int = 4, seq_len: int = 32, seed: int = 0,
                   lr: float = 1e-3, tp: int | None = None) -> dict:
    """course_lib.tensor_parallel.tp_layers over groups of tp ranks; gathered results and f/g communication counts."""
    info = get_dist_info()
    group = tensor_parallel_group(tp)
    model = seeded_gpt(seed, preset).to(info.device)  # the same full model on every rank; each keeps its slice
    stats = apply_tensor_parallel(model, group).tp_stats
    config = model.config
    batches = global_batches(steps, batch, seq_len, seed)
    activations = saved_activation_bytes(model, batches[0].to(info.device))
    first_step = {}

    @contextmanager
    def first_step_counts():  # only the training step's own all-reduces, not the measurement forward above
        stats.reset()
        yield
        first_step.update(calls=dict(stats.calls), bytes=dict(stats.bytes))

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    replicated = replicated_parameter_names(model)
    out = _train(model, optimizer, batches, lambda m, grads=False: gather_full(m, group, grads=grads),
                 first_step_counts)
    out["replicated_grads"] = {n: out["grads"][n] for n in replicated}  # this rank's own copies, not gathered
    stats.reset()
    with torch.no_grad():  # inference: only g's forward all-reduces run
        model(batches[0].to(info.device))
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    out.update(
        implementation="scratch", rank=info.rank, world_size=info.world_size,
        tp=dist.get_world_size(group), tp_rank=dist.get_rank(group),
        first_step_calls=first_step["calls"], first_step_bytes=first_step["bytes"],
        inference_calls=stats.total_calls, inference_bytes=stats.total_bytes,
        formula_bytes_per_step=config.n_layer * tp_allreduce_bytes_per_layer(batch, seq_len, config.n_embd),
        local_shapes={name: tuple(layer.weight.shape) for name, layer in
                      (("q_proj", attn.q_proj), ("o_proj", attn.o_proj), ("gate_proj", mlp.gate_proj),
                       ("down_proj", mlp.down_proj))},
        n_local_heads=attn.n_local_heads, replicated_names=replicated,
        local_params=sum(p.numel() for p in model.parameters()), saved_activation_bytes=activations,
    )
    return out


def dtensor_tp_run(steps: int = 3, preset: str = "tiny", batch: int = 4, seq_len: int = 32, seed: int = 0,
                   lr: float = 1e-3, tp: int | None = None, fuse_region_input: bool = True,
                   sequence_parallel: bool = False) -> dict:
    """course_lib.tensor_parallel.dtensor (torch's parallelize_module); DTensor's collectives counted on the first step."""
    info = get_dist_info()
    mesh = make_tp_mesh(tp)
    model = apply_dtensor_tp(seeded_gpt(seed, preset).to(info.device), mesh, fuse_region_input=fuse_region_input,
                             sequence_parallel=sequence_parallel)
    counter = CollectiveCounter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    out = _train(model, optimizer, global_batches(steps, batch, seq_len, seed),
                 lambda m, grads=False: gather_full_dtensor(m, grads=grads), lambda: counter)
    q_weight = model.blocks[0].attn.q_proj.weight
    out.update(implementation="dtensor", rank=info.rank, world_size=info.world_size, tp=mesh.size(),
               tp_rank=mesh.get_local_rank(), collectives=counter.summary(),
               q_proj_placements=str(q_weight.placements), q_proj_local_shape=tuple(q_weight.to_local().shape))
    return out


def tp_checks(runs=DEFAULT_RUNS, steps: int = 3, preset: str = "tiny", batch: int = 4, seq_len: int = 32,
              seed: int = 0) -> dict:
    """One job, several runs on the same ranks: {name: result}. Each run is (name, options) with options
    implementation ('scratch' | 'dtensor', default 'scratch'), tp, and for DTensor fuse_region_input and
    sequence_parallel."""
    common = dict(steps=steps, preset=preset, batch=batch, seq_len=seq_len, seed=seed)
    out = {}
    for name, options in runs:
        options = dict(options)
        implementation = options.pop("implementation", "scratch")
        if implementation == "scratch":
            out[name] = scratch_tp_run(**common, **options)
        elif implementation == "dtensor":
            out[name] = dtensor_tp_run(**common, **options)
        else:
            raise ValueError(f"run {name!r}: implementation must be 'scratch' or 'dtensor', got {implementation!r}")
        dist.barrier()
    return out


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

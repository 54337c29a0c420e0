"""Data parallel x tensor parallel on one device mesh: the course GPT on dp * tp ranks, equal to one process.

    python -m course_lib.hybrid.dp_tp                      # 4 CPU ranks: dp=2 x tp=2, both data-parallel variants

    from course_lib.runtime.launch import launch
    from course_lib.parity import single_process_run
    from course_lib.hybrid.dp_tp import check_parity, dp_tp_run
    ranks = launch(dp_tp_run, 4, kwargs=dict(dp=2, tp=2, steps=3), threads_per_rank=1)
    check_parity(ranks, single_process_run(steps=3))     # raises unless every rank matches one process

The mesh is init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")): ranks [[0, 1], [2, 3]] for
2 x 2, so ranks 0 and 1 form a tensor-parallel group (on a GPU cluster: two GPUs of one node) and ranks 0 and 2
a data-parallel group (course_lib.hybrid.layout computes the same groups without torch).

Tensor parallelism (Megatron-LM), applied from outside with torch's DTensor API: in every block q/k/v and gate/up
are split by output features (ColwiseParallel: a rank holds n_head / tp heads and ffn_hidden / tp hidden units),
o_proj and down_proj by input features (RowwiseParallel: partial sums, all-reduced over tp). PrepareModuleInput
makes the replicated input of attn and mlp a DTensor once, so the backward sums the gradients of q, k and v (of gate
and up) before its single all-reduce: 2 all-reduces of (batch, seq, n_embd) per layer in forward and 2 in backward,
Megatron's f and g operators (the plan is course_lib.tensor_parallel.dtensor's). Embedding, norms and lm_head stay
replicated; the all-reduce in backward makes their gradients equal on the tp ranks.

Data parallelism over dp, two ways (`data_parallel`), both working on CPU/gloo with torch 2.13:
  "allreduce"  after backward, all-reduce each gradient over the dp group only (the local shard of a
               TP-sharded one) and divide by dp: DDP's arithmetic, explicit, one collective per tensor.
  "fsdp"       fully_shard(block, mesh=dp_mesh) over the tensor-parallel model (FSDP2, as torchtitan does):
               parameters become 2D DTensors (sharded over tp, then over dp), all-gathered for compute;
               gradients are reduce-scattered. Same arithmetic, 1/dp of the model states per rank.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from course_lib.core.model import GPT, GPTConfig
from course_lib.core.steps import train_step
from course_lib.data_parallel.ddp import allreduce_gradients
from course_lib.sharding.fsdp import apply_fsdp
from course_lib.runtime.launch import launch, run_each
from course_lib.tensor_parallel.dtensor import apply_dtensor_tp, full_copy
from course_lib.tensor_parallel.tp_layers import check_tensor_parallel_config
from course_lib.parity import global_batches, local_rows, seeded_gpt, single_process_run

DATA_PARALLEL = ("allreduce", "fsdp")


def tp_collective_counts(model: GPT, idx: torch.Tensor) -> dict:
    """Collectives issued by one forward and one forward + backward of the TP model (CommDebugMode counts)."""
    counts = {}
    for phase in ("forward", "forward_backward"):
        mode = CommDebugMode()
        with mode:  # forward and backward inside one `with`: the mode tracks modules across both
            _, loss = model(idx, targets=idx)
            if phase == "forward_backward":
                loss.backward()
        counts[phase] = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    model.zero_grad(set_to_none=True)
    return counts


def dp_tp_run(dp: int = 2, tp: int = 2, steps: int = 3, preset: str = "tiny", global_batch: int = 8,
              seq_len: int = 32, seed: int = 0, data_parallel: str = "allreduce") -> dict:
    """Train `steps` AdamW steps on a (dp, tp) mesh; each dp replica takes its rows of the global batch.

    Runs on every rank. Returns this rank's mesh coordinates and groups (as torch formed them), its local
    losses, the first step's gradients and the final parameters (whole tensors), and the TP collectives
    counted in one forward and backward.
    """
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    world_size = dist.get_world_size()
    if dp * tp != world_size:
        raise ValueError(f"dp * tp = {dp} * {tp} = {dp * tp} must equal the world size ({world_size})")
    if global_batch % dp:
        raise ValueError(f"global_batch ({global_batch}) must be divisible by dp ({dp})")
    config = GPTConfig.from_preset(preset)
    check_tensor_parallel_config(config, tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    batches = [local_rows(batch, mesh.get_local_rank("dp"), dp)
               for batch in global_batches(steps, global_batch, seq_len, seed)]
    # The same initial weights on every rank, as in single_process_run; course_lib.tensor_parallel.dtensor's plan.
    model = apply_dtensor_tp(seeded_gpt(seed, config=config), mesh["tp"])
    counts = tp_collective_counts(model, batches[0])
    local_shapes = {name: tuple(p.to_local().shape) for name, p in model.blocks[0].named_parameters()
                    if isinstance(p, DTensor)}
    if data_parallel == "fsdp":
        apply_fsdp(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # single_process_run's

    losses, first_grads = [], []

    def average_and_keep():  # "allreduce": DDP's arithmetic over the dp group; the first step's gradients, whole
        if data_parallel == "allreduce":
            allreduce_gradients(model, mesh.get_group("dp"))
        if not first_grads:
            first_grads.append({name: full_copy(p.grad) for name, p in model.named_parameters()})

    for rows in batches:
        optimizer.zero_grad(set_to_none=True)
        losses.append(train_step(model, [rows], optimizer, after_backward=average_and_keep, grad_norm=False)["loss"])
    first_grads = first_grads[0]
    return {"rank": dist.get_rank(), "data_parallel": data_parallel,
            "coords": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())),
            "groups": {dim: tuple(dist.get_process_group_ranks(mesh.get_group(dim))) for dim in ("dp", "tp")},
            "losses": losses, "grads": first_grads, "local_shapes": local_shapes, "tp_collectives": counts,
            "params": {name: full_copy(p) for name, p in model.named_parameters()}}


def check_parity(ranks: list[dict], reference: dict) -> dict:
    """Assert every rank equals one process on the whole global batch; return the largest differences.

    ranks: dp_tp_run's results (one per rank); reference: course_lib.parity.single_process_run's.
    The tp ranks of one replica see the same rows, so their losses are equal; the replicas see different
    rows, and the mean of their losses is the global batch's loss.
    """
    worst = {"grads": 0.0, "params": 0.0}
    for result in ranks:
        where = f"{result['data_parallel']}, rank {result['rank']} {result['coords']}"
        for kind in worst:
            for name, expected in reference[kind].items():
                got = result[kind][name]
                # parameters after AdamW steps: a gradient that differs in its last bits (matmuls split over other
                # core counts) moves an element whose gradient is near zero by more than fp32's default tolerance
                tolerance = {"rtol": 1e-4, "atol": 1e-4} if kind == "params" else {}
                torch.testing.assert_close(got, expected, **tolerance, msg=lambda m: f"{where}: {kind} {name}: {m}")
                worst[kind] = max(worst[kind], (got - expected).abs().max().item())
    replicas = {}
    for result in ranks:
        replicas.setdefault(result["coords"]["dp"], []).append(result["losses"])
    for dp_rank, losses in replicas.items():
        assert all(l == losses[0] for l in losses), f"tp ranks of replica {dp_rank} disagree on the loss: {losses}"
    mean_losses = torch.tensor([losses[0] for losses in replicas.values()]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    worst["loss"] = (mean_losses - torch.tensor(reference["losses"])).abs().max().item()
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--data-parallel", nargs="+", default=list(DATA_PARALLEL), choices=DATA_PARALLEL)
    args = parser.parse_args(argv)
    kwargs = dict(dp=args.dp, tp=args.tp, steps=args.steps, preset=args.preset)
    with tempfile.TemporaryDirectory(prefix="rank-logs-") as log_dir:
        runs = {variant: (dp_tp_run, dict(data_parallel=variant, **kwargs)) for variant in args.data_parallel}
        ranks = launch(run_each, args.dp * args.tp, args=(runs,), log_dir=log_dir, threads_per_rank=1, echo=False)
    reference = single_process_run(steps=args.steps, preset=args.preset)
    for variant in args.data_parallel:
        results = [r[variant] for r in ranks]
        for r in results:
            print(f"{variant:>9} rank {r['rank']} {r['coords']}: dp group {r['groups']['dp']}, "
                  f"tp group {r['groups']['tp']}, local losses {[round(l, 4) for l in r['losses']]}")
        worst = check_parity(results, reference)
        print(f"{variant:>9}: equal to one process on the global batch (largest differences: "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ")")
    counts = Counter(ranks[0][args.data_parallel[0]]["tp_collectives"]["forward_backward"])
    print(f"tensor-parallel collectives in one forward + backward of {args.preset} "
          f"({GPTConfig.from_preset(args.preset).n_layer} layers): {dict(counts)}")


if __name__ == "__main__":
    main()

"""parallelize(model, layout, mesh): the one road from a plain GPT to any layout the course teaches.

The model and the training loop never change; only the wrapping does. `parallelize` applies the course's
`apply_*` functions in the one order that composes:

    1. pipeline split   GPTStage: this rank keeps its stage's blocks (and the embedding / head at the ends)
    2. tensor parallel  apply_dtensor_tp on the model or the stage (+ sequence parallelism)
    3. sharding         FSDP2 over the dp ranks (apply_fsdp), or ZeRO from scratch, built with the optimizer
    4. replication      torch DDP or the course's BucketedDataParallel over the dp ranks (apply_ddp); with tp or
                        pp the dp ranks all-reduce each gradient (shard) after backward instead

(torchtitan splits the pipeline first too: tensor parallelism is then applied to each stage's blocks.)
The result, a `Parallelized`, is what course_lib.core.steps.train_step drives: it runs forward and backward over a
step's micro-batches (through the pipeline schedule when pp > 1), averages gradients over the replicas, computes
the global gradient norm across every shard and stage, builds the optimizer (ZeRO's own when zero > 0) and
evaluates. Every rank of the job calls it with the same model (same seed) and the same layout:

    layout = Layout(dp=2, tp=2, pp=2)
    mesh = build_mesh(layout)
    par = parallelize(GPT(config), layout, mesh)
    optimizer = par.make_optimizer(lr=3e-3, weight_decay=0.1)
    stats = train_step(par, micro_batches, optimizer, scheduler, grad_clip=1.0)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from course_lib.core.data import eval_batches
from course_lib.core.model import GPT
from course_lib.core.optim import configure_optimizer
from course_lib.core.steps import accumulate_gradients, clip_gradients, evaluate
from course_lib.data_parallel.ddp import allreduce_gradients
from course_lib.data_parallel.torch_ddp import apply_ddp
from course_lib.parallel.layout import Layout
from course_lib.pipeline_parallel.stage import PipelineRunner, allreduce_tied_grad, apply_pipeline
from course_lib.sharding import apply_zero
from course_lib.sharding.fsdp import apply_fsdp
from course_lib.sharding.zero import ZeroAdamW
from course_lib.tensor_parallel.dtensor import apply_dtensor_tp


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Parallelized:
    """A model under a Layout on this rank: what one training step and evaluation need to know about it.

    model    the module whose parameters this rank trains (the GPT, or its pipeline stage): optimizer, state dict
    module   what the forward runs through (a DDP wrapper, or `model` itself)
    dp_rank, dp_size   which rows of every global batch this rank's replica takes
    """

    def __init__(self, *, layout: Layout, mesh, model: nn.Module, module: nn.Module, runner=None, tied_group=None):
        self.layout, self.mesh, self.model, self.module = layout, mesh, model, module
        self.runner, self.tied_group = runner, tied_group
        self.dp_group = mesh["dp"].get_group() if mesh is not None else None
        self.pp_group = mesh["pp"].get_group() if mesh is not None and layout.pp > 1 else None
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.dp_size = layout.dp
        self.no_sync = getattr(module, "no_sync", None)
        self.optimizer = None

    # ---------------------------------------------------------------------------------- the optimizer
    def make_optimizer(self, lr: float, weight_decay: float = 0.1) -> torch.optim.Optimizer:
        """AdamW over this rank's parameters (decay on matrices only), or ZeRO's sharded AdamW (zero > 0).

        Call once, before the first step: ZeRO broadcasts rank 0's weights and, at stage 3, shards them."""
        if self.layout.zero:
            zero = apply_zero(self.model, self.layout.zero, lr=lr, weight_decay=weight_decay, group=self.dp_group)
            self.optimizer = ZeroAdamW(zero, lr)
        else:
            self.optimizer = configure_optimizer(self.model, lr, weight_decay)
        return self.optimizer

    # ---------------------------------------------------------------------------------- one step's work
    def forward_backward(self, micro_batches, *, amp_dtype=None, scaler=None) -> torch.Tensor:
        """Forward + backward over the step's micro-batches; gradients end averaged over the replicas.

        Returns this replica's mean loss (every rank of the replica gets it, the pipeline's too)."""
        if self.runner is not None:
            loss = self._pipeline_step(torch.cat(list(micro_batches)))
        else:
            loss = accumulate_gradients(self.module, micro_batches, amp_dtype=amp_dtype, scaler=scaler,
                                        no_sync=self.no_sync)
            if hasattr(self.module, "finish_gradient_sync"):  # the course's bucketed DDP: wait for its buckets
                self.module.finish_gradient_sync()
        if self.layout.dp > 1 and (self.layout.tp > 1 or self.layout.pp > 1) and not self.layout.fsdp:
            allreduce_gradients(self.model, group=self.dp_group)  # a DTensor gradient: its local shard
        return loss

    def _pipeline_step(self, tokens: torch.Tensor) -> torch.Tensor:
        stage = self.runner.stage
        local = self.runner.step(tokens)  # the last stage's loss; gradients accumulate in .grad
        allreduce_tied_grad(stage, self.tied_group)  # the embedding's two copies: one gradient
        loss = torch.tensor(local if local is not None else 0.0, dtype=torch.float32, device=tokens.device)
        dist.broadcast(loss, src=self.runner.peers[-1], group=self.pp_group)
        return loss

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The gradient norm of the whole model (before clipping) and, with max_norm, every gradient scaled to it.

        Each tensor is counted once: a tensor-parallel shard's norm is reduced over its tp ranks (DTensor does
        it), a replicated tensor counts once, the pipeline stages add their squares, the tied embedding's
        second copy is left out."""
        if isinstance(self.optimizer, ZeroAdamW):
            return self.optimizer.clip_grad_norm(max_norm)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.layout.tp == 1 and self.layout.pp == 1:
            return clip_gradients(params, max_norm)  # plain tensors, or FSDP's DTensors: torch's clip handles both
        counted = params
        stage = self.runner.stage if self.runner is not None else None
        if stage is not None and stage.is_last and not stage.is_first:
            counted = [p for p in params if p is not stage.lm_head.weight]  # stage 0 counts the tied matrix
        norms = []
        for param in counted:
            norm = torch.linalg.vector_norm(param.grad)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        square = torch.stack(norms).pow(2).sum() if norms else torch.zeros(())
        if self.pp_group is not None:
            dist.all_reduce(square, group=self.pp_group)
        total = square.sqrt()
        if max_norm:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
            for param in params:
                param.grad.mul_(coef)
        return total

    # ---------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, tokens, *, batch_size: int, block_size: int, max_batches: int | None,
                 amp_dtype=None) -> float:
        """Mean loss over the first max_batches validation batches of batch_size rows, equal on every rank.

        The replicas split the batches when their forwards need no one else's (DDP, ZeRO-1/2, tp, pp); with
        sharded parameters (FSDP, ZeRO-3) every rank runs every batch, because each forward gathers weights."""
        if self.runner is not None:
            return self._pipeline_evaluate(tokens, batch_size, block_size, max_batches)
        split = not (self.layout.fsdp or self.layout.zero == 3)
        return evaluate(self.model, tokens, batch_size=batch_size, block_size=block_size, max_batches=max_batches,
                        amp_dtype=amp_dtype, rank=self.dp_rank if split else 0,
                        world_size=self.dp_size if split else 1, group=self.dp_group)

    def _pipeline_evaluate(self, tokens, batch_size, block_size, max_batches) -> float:
        was_training = self.model.training
        self.model.eval()
        device = self.runner.device
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for i, idx in enumerate(eval_batches(tokens, batch_size, block_size, max_batches)):
            if i % self.dp_size != self.dp_rank:
                continue
            loss = self.runner.forward_loss(idx)
            if loss is not None:
                sums += torch.tensor([loss * idx.size(0), idx.size(0)], dtype=torch.float64, device=device)
        self.model.train(was_training)
        dist.all_reduce(sums)  # only last stages hold sums; every rank gets the total
        return (sums[0] / sums[1]).item()

    # ---------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """What a distributed checkpoint (torch.distributed.checkpoint) saves of this rank's model and optimizer.

        Replicated tensors carry the same key on every rank (saved once), sharded ones are DTensors, and ZeRO's
        per-rank shards carry the rank in their key."""
        if isinstance(self.optimizer, ZeroAdamW):
            rank, parts = self.optimizer.zero.rank, self.optimizer.zero.world_size
            state = {"zero": {f"shard{rank}of{parts}": self.optimizer.shard_state()}}
            if self.layout.zero < 3:
                state["model"] = self.model.state_dict()
            return state
        # Flattened: the optimizer's state and settings keyed by parameter name, so pipeline stages (which hold
        # different parameters) never write different values under one key.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FLAT)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state: dict) -> None:
        """Put a state_dict() that the checkpoint loader filled back into the model and the optimizer."""
        if isinstance(self.optimizer, ZeroAdamW):
            (shard,) = state["zero"].values()
            self.optimizer.load_shard_state(shard)
            if "model" in state:
                self.model.load_state_dict(state["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=FLAT)


# -------------------------------------------------------------------------------------- parallelize
def _tied_weight_group(mesh):
    """The process group of this rank's first and last pipeline stage (every rank creates every pair, in order)."""
    grid = mesh.mesh  # (dp, pp, tp) global ranks
    mine = None
    for d in range(grid.shape[0]):
        for t in range(grid.shape[2]):
            pair = [int(grid[d, 0, t]), int(grid[d, -1, t])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


def parallelize(model: nn.Module, layout: Layout, mesh=None, *, fsdp_strategy: str = "FULL_SHARD",
                mp_policy=None) -> Parallelized:
    """Apply `layout` to `model` on this rank (all ranks call it with the same model and layout).

    mesh: the job's ('dp', 'pp', 'tp') DeviceMesh (course_lib.parallel.build_mesh), None for one process.
    fsdp_strategy, mp_policy: passed to apply_fsdp when layout.fsdp (HYBRID_SHARD, bf16 compute, ...).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a course_lib.parallel.Layout, got {type(layout).__name__}")
    if mesh is None and layout.world_size > 1:
        raise ValueError(f"the layout {layout.name()!r} spans {layout.world_size} ranks: pass its mesh "
                         "(course_lib.parallel.build_mesh(layout))")
    if mesh is not None and tuple(mesh.mesh_dim_names) != ("dp", "pp", "tp"):
        raise ValueError(f"mesh must have the dimensions ('dp', 'pp', 'tp'), got {mesh.mesh_dim_names}")
    runner = tied_group = None
    if layout.pp > 1:  # 1. the pipeline split: this rank keeps one stage
        if not isinstance(model, GPT):
            raise TypeError(f"a pipeline layout cuts a course_lib.core.model.GPT into stages, got {type(model).__name__}")
        tied_group = _tied_weight_group(mesh)
        model = apply_pipeline(model, mesh["pp"].get_local_rank(), layout.pp, tied_group)
    if layout.tp > 1:  # 2. tensor (and sequence) parallelism on the blocks
        apply_dtensor_tp(model, mesh["tp"], sequence_parallel=layout.sp)
    module = model
    if layout.fsdp:  # 3. sharding with torch; ZeRO is built by make_optimizer
        apply_fsdp(model, mesh=mesh["dp"] if layout.tp > 1 else None, strategy=fsdp_strategy, mp_policy=mp_policy)
    elif layout.dp > 1 and layout.tp == 1 and layout.pp == 1 and not layout.zero:  # 4. replication
        module = apply_ddp(model, group=mesh["dp"].get_group(), impl=layout.ddp)
    if layout.pp > 1:
        runner = PipelineRunner(model, layout.schedule, layout.micro_batches, group=mesh["pp"].get_group())
    return Parallelized(layout=layout, mesh=mesh, model=model, module=module, runner=runner, tied_group=tied_group)

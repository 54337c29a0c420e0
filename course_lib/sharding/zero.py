"""ZeRO from scratch: shard the optimizer states (stage 1), then the gradients (stage 2), then the parameters
(stage 3, in course_lib.sharding.zero3) over the data-parallel ranks, as in Rajbhandari et al., "ZeRO" (2020).

Every rank sees the model's trainable parameters as one flat vector of P elements (in `named_parameters()`
order), padded with zeros to ceil(P / N) * N so that each of the N ranks owns exactly S = ceil(P / N)
consecutive elements; the last rank's tail is padding. What a rank keeps, after `step()`:

    stage 0 (DDP)  full params, full grads (all-reduced), AdamW state of all P elements
    stage 1        full params, full local grads, AdamW state of its S elements only
    stage 2        full params, its S-element gradient shard, AdamW state of its S elements
    stage 3        its S-element parameter shard, gradient shard and AdamW state (course_lib.sharding.zero3)

AdamW state = exp_avg and exp_avg_sq (fp32), plus, in precision="mixed", an fp32 master copy of the
shard (the parameters and gradients are then bf16): K = 12 bytes per element; in "fp32" the parameters
are the fp32 weights and K = 8. Gradients are always *summed over the ranks in fp32*: in "mixed" each bf16
gradient is cast to fp32 before its collective, so the N contributions are added without bf16 rounding
(the "reduce in fp32" of FSDP's reduce_dtype). The stored gradients stay bf16, the 2 bytes of the ZeRO
paper's 2 + 2 + K: stage 1 hands the fp32 average straight to AdamW, stages 2 and 3 round it to bf16 once,
into their gradient shard. The gradient collectives then carry 4 bytes per element instead of 2.

Each rank needs the averaged gradient of its shard only, so stages 1 and 2 reduce-scatter the gradients
(stage 1 after backward, stage 2 during it), update their shard, then an all-gather rebuilds the full
parameters: Psi + Psi elements on the wire, the 2 Psi of DDP's all-reduce.
Use it inside every rank of a job (course_lib.runtime.launch or torchrun):

    zero = apply_zero(model, stage=2, lr=1e-3, weight_decay=0.1)
    for batch in batches:
        zero.zero_grad()
        _, loss = model(batch, targets=batch)
        loss.backward()      # stages 2 and 3: a hook reduce-scatters each gradient as soon as it is ready
        zero.step()          # AdamW on this rank's shard; stages 1 and 2: all-gather the new parameters

The update equals torch.optim.AdamW over course_lib.core.optim.param_groups (no weight decay on 1-D parameters);
tests/sharding/test_zero.py checks the result against torch DDP and one process. Try it:

    python -m pytest -q tests/sharding/test_zero.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.core.optim import param_groups
from course_lib.data_parallel.ddp import allreduce_gradients, broadcast_parameters
from course_lib.data_parallel.collectives import all_gather_single, reduce_scatter_single, shard_numel

STAGES = (0, 1, 2, 3)
COMPUTE_DTYPES = {"fp32": torch.float32, "mixed": torch.bfloat16}


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in the flat vector, and which slice of it shard `index` of `parts` owns."""

    numels: tuple[int, ...]
    parts: int  # number of shards: the world size, or 1 for stage 0 (every rank holds everything)
    index: int  # the shard this rank owns

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return shard_numel(self.numel, self.parts)

    @property
    def start(self) -> int:
        return self.index * self.shard_numel

    @property
    def offsets(self) -> list[int]:
        return [sum(self.numels[:i]) for i in range(len(self.numels))]

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """For every shard r, the part of the flat range [lo, hi) it owns, as (start, end); empty if start == end."""
        S = self.shard_numel
        return [(min(max(lo, r * S), hi), max(min(hi, (r + 1) * S), lo)) for r in range(self.parts)]

    def my_shard(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        """This rank's S elements of the flattened tensors (a new tensor; the padding tail is zero)."""
        shard = torch.zeros(self.shard_numel, dtype=dtype, device=tensors[0].device)
        for tensor, offset in zip(tensors, self.offsets):
            lo, hi = self.pieces(offset, offset + tensor.numel())[self.index]
            shard[lo - self.start:hi - self.start] = tensor.detach().reshape(-1)[lo - offset:hi - offset]
        return shard

    def flatten(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        """All tensors in one new vector of parts * shard_numel elements (the padding tail is zero)."""
        flat = torch.zeros(self.shard_numel * self.parts, dtype=dtype, device=tensors[0].device)
        for tensor, offset in zip(tensors, self.offsets):
            flat[offset:offset + tensor.numel()] = tensor.detach().reshape(-1)
        return flat

    def unflatten_into(self, flat: torch.Tensor, tensors) -> None:
        """Copy the full flat vector (padding ignored) back into the tensors."""
        with torch.no_grad():
            for tensor, offset in zip(tensors, self.offsets):
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))


class ShardedAdamW:
    """torch.optim.AdamW's update (decoupled weight decay) on one flat fp32 shard.

    `decay_slices` lists (lo, hi, weight_decay) slices of the shard, one per parameter piece it holds; the
    padding tail is in none of them and, with a zero gradient, stays exactly zero. The step count is a
    Python int: unlike torch's AdamW (one fp32 `step` tensor per parameter) it takes no tensor memory.
    A learning-rate schedule sets `lr` before each step (zero.adam.lr = get_lr(step, ...)).
    """

    def __init__(self, numel: int, decay_slices, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 device: torch.device | str = "cpu"):
        self.lr, self.betas, self.eps, self.decay_slices = lr, betas, eps, decay_slices
        self.exp_avg = torch.zeros(numel, device=device)
        self.exp_avg_sq = torch.zeros(numel, device=device)
        self.steps = 0

    @torch.no_grad()
    def step(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Update the fp32 `param` shard in place from its fp32 `grad` shard (same order of operations as torch)."""
        beta1, beta2 = self.betas
        self.steps += 1
        for lo, hi, weight_decay in self.decay_slices:
            if weight_decay:
                param[lo:hi].mul_(1 - self.lr * weight_decay)
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** self.steps
        bias_correction2_sqrt = (1 - beta2 ** self.steps) ** 0.5
        denom = (self.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(self.exp_avg, denom, value=-self.lr / bias_correction1)


class ZeroOptimizer:
    """ZeRO stages 0, 1 and 2 over `group` (default: all ranks). Stage 3 is course_lib.sharding.zero3.Zero3Optimizer.

    Stage 2 reduce-scatters *during* backward: a post-accumulate-grad hook on every parameter sends that
    parameter's gradient (summed over ranks, divided by N) to the ranks owning its elements, adds it into
    the rank's gradient shard and frees the full `.grad` at once. At most a few full gradients are alive at
    any moment of backward (those still accumulating, e.g. the tied embedding's), never all of them.
    """

    def __init__(self, model: nn.Module, stage: int, *, lr: float, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, precision: str = "fp32",
                 group=None):
        if stage == 3:
            raise ValueError("stage 3 shards the parameters too: use course_lib.sharding.apply_zero(model, 3, ...) "
                             "or course_lib.sharding.zero3.Zero3Optimizer")
        self._setup(model, stage, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, precision=precision,
                    group=group)

    def _setup(self, model: nn.Module, stage: int, *, lr: float, weight_decay: float = 0.1,
               betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, precision: str = "fp32", group=None):
        """Everything but the choice of class: Zero3Optimizer calls this with stage 3."""
        _check_arguments(model, stage, lr, weight_decay, precision)
        self.model, self.stage, self.precision, self.group = model, stage, precision, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.dtype = COMPUTE_DTYPES[precision]
        broadcast_parameters(model, group=group)  # every replica starts from rank 0's weights, as DDP does
        self.params = self._flat_order(model)
        self.names = {p: n for n, p in model.named_parameters()}
        sharded = stage >= 1
        self.layout = FlatLayout(tuple(p.numel() for p in self.params), self.world_size if sharded else 1,
                                 self.rank if sharded else 0)
        self.offset_of = dict(zip(self.params, self.layout.offsets))
        decay = {p: g["weight_decay"] for g in param_groups(model, weight_decay) for p in g["params"]}
        slices = []
        for param, offset in zip(self.params, self.layout.offsets):
            lo, hi = self.layout.pieces(offset, offset + param.numel())[self.layout.index]
            if hi > lo:
                slices.append((lo - self.layout.start, hi - self.layout.start, decay[param]))
        # Mixed precision: the fp32 master shard is taken before the model is cast to bf16.
        self.master = self.layout.my_shard(self.params, torch.float32) if precision == "mixed" else None
        model.to(self.dtype)
        self.device = self.params[0].device
        self.adam = ShardedAdamW(self.layout.shard_numel, slices, lr=lr, betas=betas, eps=eps, device=self.device)
        self.grad_shard = (torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
                           if stage >= 2 else None)
        self.ready: set[nn.Parameter] = set()
        # Elements handed to collectives, in the ZeRO paper's accounting (an all-reduce counts twice: it is
        # a reduce-scatter plus an all-gather). Divide by P for "communication volume in units of Psi".
        self.comm_volume = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
        if stage >= 2:
            for param in self.params:
                param.register_post_accumulate_grad_hook(self._grad_ready)

    def _flat_order(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]  # a tied tensor appears once

    # ------------------------------------------------------------------------------ gradients
    def _grad_ready(self, param: nn.Parameter) -> None:
        """Hook (stages 2, 3): reduce-scatter this gradient into the owners' shards, then free it."""
        offset = self.offset_of[param]
        grad = param.grad.reshape(-1).float()  # reduce in fp32 (a copy in "mixed"; the tensor itself in "fp32")
        pieces = self.layout.pieces(offset, offset + grad.numel())
        inputs = [grad[lo - offset:hi - offset] for lo, hi in pieces]  # uneven: most ranks own none of it
        lo, hi = pieces[self.rank]
        mine = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
        dist.reduce_scatter(mine, inputs, op=dist.ReduceOp.SUM, group=self.group)
        # The shard has the compute dtype (bf16 in "mixed"): the fp32 average is rounded once, here.
        self.grad_shard[lo - self.layout.start:hi - self.layout.start].add_(mine.div_(self.world_size))
        self.comm_volume["reduce_scatter"] += grad.numel()
        param.grad = None
        self.ready.add(param)

    def _my_gradient(self) -> torch.Tensor:
        """This rank's gradient shard, averaged over the ranks, in fp32."""
        if self.stage >= 2:
            missing = [self.names[p] for p in self.params if p not in self.ready]
            if missing:
                raise RuntimeError(f"no gradient reached ZeRO for {missing}: call loss.backward() before step(), "
                                   "and use every parameter in the loss")
            self.ready.clear()
            return self.grad_shard.float()
        missing = [self.names[p] for p in self.params if p.grad is None]
        if missing:
            raise RuntimeError(f"parameters without .grad: {missing}; call loss.backward() before step()")
        if self.stage == 0:  # DDP: every rank gets the full averaged gradient, 2 Psi of traffic
            self.comm_volume["all_reduce"] += 2 * self.layout.numel
            if self.dtype == torch.float32:
                allreduce_gradients(self.model, group=self.group)
                return self.layout.my_shard([p.grad for p in self.params], torch.float32)
            flat = self.layout.flatten([p.grad for p in self.params], torch.float32)  # bf16 grads, summed in fp32
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            return flat.div_(self.world_size)
        # Stage 1 keeps the full local gradients (the memory stage 2 saves), but a rank needs the average of
        # its own shard only: one reduce-scatter of the padded flat gradient, half the traffic of an all-reduce.
        # The flat copy is fp32 whatever the compute dtype, so the sum over the ranks is not rounded to bf16.
        flat = self.layout.flatten([p.grad for p in self.params], torch.float32)
        mine = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=self.device)
        reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM, group=self.group)
        self.comm_volume["reduce_scatter"] += flat.numel()
        return mine.div_(self.world_size)

    # ------------------------------------------------------------------------------ the step
    def step(self) -> None:
        """AdamW on this rank's shard, then publish the new parameters to every rank."""
        self.update(self._my_gradient())

    def averaged_gradient(self) -> torch.Tensor:
        """This rank's shard of the gradient averaged over the ranks (fp32), for a caller that clips it before
        `update`: step() = update(averaged_gradient()). Call once per step, after backward."""
        return self._my_gradient()

    def update(self, grad: torch.Tensor) -> None:
        """AdamW on this rank's shard with `grad` (from averaged_gradient), then publish the new parameters."""
        if self.master is not None:  # mixed: update the fp32 master, compute with its bf16 copy
            self.adam.step(self.master, grad)
            self._publish(self.master.to(self.dtype))
        else:  # fp32: the shard of the parameters themselves is updated (a temporary copy in stages 0-2)
            shard = self.layout.my_shard(self.params, torch.float32)
            self.adam.step(shard, grad)
            self._publish(shard)

    def _publish(self, shard: torch.Tensor) -> None:
        """Stages 0-2: every rank needs the full parameters, so gather all shards (stage 0: nothing to gather)."""
        if self.layout.parts == 1:
            full = shard
        else:
            full = torch.empty(self.layout.shard_numel * self.layout.parts, dtype=shard.dtype, device=self.device)
            all_gather_single(full, shard, group=self.group)
            self.comm_volume["all_gather"] += full.numel()
        self.layout.unflatten_into(full, self.params)

    def zero_grad(self) -> None:
        """Free the full gradients; zero the gradient shard (stages 2, 3), which backward adds into."""
        for param in self.params:
            param.grad = None
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    # ------------------------------------------------------------------------------ inspection
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors ZeRO itself holds on this rank, by kind, for zero_memory.measure_model_states(extra=...).

        The model's own parameters and .grad are not listed: measure_model_states reads them from the model.
        """
        states = [self.adam.exp_avg, self.adam.exp_avg_sq] + ([self.master] if self.master is not None else [])
        return {"params": [], "grads": [self.grad_shard] if self.grad_shard is not None else [],
                "optimizer_states": states}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> a copy of the full parameter (stage 3 gathers it: call it on every rank)."""
        return {self.names[p]: p.detach().clone() for p in self.params}


class ZeroAdamW(torch.optim.Optimizer):
    """ZeRO (course_lib.sharding) seen as a torch optimizer, so the loop's LR scheduler, zero_grad and step drive
    it like any other. It holds no parameters of its own (a zero-size placeholder keeps torch's bookkeeping
    happy): `param_groups[0]['lr']` is copied into ZeRO's sharded AdamW before each step.

    clip_grad_norm(max_norm) takes the averaged gradient shard, measures the global norm (each rank's shard
    squared and summed, all-reduced over the dp ranks: the padding is zero) and scales the shard; step() then
    updates with it.
    """

    def __init__(self, zero: ZeroOptimizer, lr: float):
        self.zero = zero
        super().__init__([nn.Parameter(torch.zeros(0))], {"lr": lr})
        self._clipped: torch.Tensor | None = None

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        grad = self.zero.averaged_gradient()
        square = grad.pow(2).sum()
        dist.all_reduce(square, group=self.zero.group)
        norm = square.sqrt()
        if max_norm:
            grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        self._clipped = grad
        return norm

    def step(self, closure=None):
        grad, self._clipped = self._clipped, None
        self.zero.adam.lr = self.param_groups[0]["lr"]
        self.zero.update(grad if grad is not None else self.zero.averaged_gradient())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad()

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's AdamW state (and, stage 3, its parameter shard): what a checkpoint must keep per rank."""
        adam = self.zero.adam
        state = {"exp_avg": adam.exp_avg, "exp_avg_sq": adam.exp_avg_sq,
                 "steps": torch.tensor(adam.steps, dtype=torch.int64)}
        if self.zero.master is not None:
            state["master"] = self.zero.master
        if self.zero.stage == 3:
            state["param_shard"] = self.zero.param_shard
        return state

    def load_shard_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a shard_state() back in (the tensors of `state` were filled by the checkpoint loader)."""
        mine = self.shard_state()
        for name, tensor in state.items():
            if name == "steps":
                self.zero.adam.steps = int(tensor)
            else:
                mine[name].copy_(tensor)


def _check_arguments(model, stage, lr, weight_decay, precision) -> None:
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES} (0 = plain data parallelism), got {stage!r}")
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be one of {sorted(COMPUTE_DTYPES)}, got {precision!r}")
    if not lr > 0 or weight_decay < 0:
        raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={lr!r}, weight_decay={weight_decay!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters: nothing for ZeRO to shard")
    if not dist.is_initialized():
        raise RuntimeError("ZeRO needs a process group: run inside course_lib.runtime.launch.launch or torchrun "
                           "(or call course_lib.runtime.env.init_distributed() first)")


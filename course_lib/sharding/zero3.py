"""ZeRO stage 3: shard the parameters too, and gather each unit of the model just in time.

Between steps a rank holds only its S = ceil(P / N) elements of the flat parameter vector (`param_shard`).
The model is cut into *units* (course GPT: the token embedding, every transformer block, the final norm).
Each unit has a full-size `buffer`, and its parameters are views into it; the buffer's storage is resized to
0 bytes whenever the unit is not needed, so the views cost no memory. Around every use of a unit:

    forward pre-hook    gather: the ranks owning pieces of the unit broadcast them into its buffer
    forward hook        free the buffer again; put a hook on the unit's output for the backward pass
    output's grad hook  gather again, just before autograd runs the unit's backward (it needs the weights)
    grad-ready hook     reduce-scatter each parameter's gradient into the owners' gradient shards (as
                        stage 2); when the last gradient of the unit is done, free the buffer

The saved tensors of autograd are views of the same storage, so they see the re-gathered values. This is
the ZeRO paper's schedule (section 7.2.2): "the data parallel process responsible for that partition can
broadcast the weights to all the data parallel processes", forward and again for backward, so the
parameters travel twice and the gradients once: 3 Psi instead of DDP's 2 Psi. Gathering a unit with
broadcasts from its owners keeps the one padding rule of course_lib.sharding.zero (a single flat vector); FSDP and
DeepSpeed instead shard every unit (or parameter) across all ranks, padding each, so that every gather is
one all-gather in which all links work at once.

A module outside a unit that uses one of its parameters (the course GPT's `lm_head`, tied to the
embedding) gets the same hooks, so the embedding is gathered for it too. What exists transiently: during
forward, the buffer of the unit running; during backward, the unit's buffer plus its full gradients until
they are reduce-scattered (the tied embedding stays gathered from `lm_head`'s backward to the embedding's).
`peak_gathered_bytes` records the most parameter bytes gathered at once.

    zero = apply_zero(model, stage=3, lr=1e-3)          # course_lib.sharding.apply_zero; same loop as stage 2
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.data_parallel.collectives import all_gather_single
from course_lib.sharding.zero import ZeroOptimizer


class Unit:
    """A group of parameters gathered and freed together; `users` are the modules whose hooks gather it."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], start: int, end: int,
                 dtype: torch.dtype, device: torch.device):
        self.name, self.module, self.params, self.start, self.end = name, module, params, start, end
        self.buffer = torch.empty(end - start, dtype=dtype, device=device)  # the full parameters, while gathered
        self.users = [module]
        self.gathered = True

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every child module with trainable parameters of its own, a ModuleList's children one by one.

    Course GPT: tok_emb, blocks.0, blocks.1, ..., norm_f. lm_head is no unit: its weight is tok_emb's.
    """
    units, seen = [], set()
    for name, child in model.named_children():
        children = child.named_children() if isinstance(child, nn.ModuleList) else [("", child)]
        for sub, module in children:
            new = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
            if new:
                units.append((f"{name}.{sub}" if sub else name, module))
                seen.update(id(p) for p in new)
    return units


def _tensors(output) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if torch.is_tensor(t)]
    return []


class Zero3Optimizer(ZeroOptimizer):
    """ZeRO stage 3 over `group`; keyword arguments as course_lib.sharding.zero.ZeroOptimizer, plus `units`.

    units: [(name, module), ...] gathered as wholes (default: default_units(model)). A trainable parameter
    that belongs to no unit is an error (it would have no hook to gather it).
    """

    def __init__(self, model: nn.Module, *, units: list[tuple[str, nn.Module]] | None = None, **kwargs):
        if getattr(getattr(model, "config", None), "activation_checkpointing", False):
            raise ValueError("GPTConfig.activation_checkpointing must be False for this ZeRO-3: recomputing a "
                             "block inside backward would run its forward hook, which frees the weights it needs")
        self._unit_modules = units if units is not None else default_units(model)
        self._setup(model, 3, **kwargs)
        self.param_shard = self.layout.my_shard(self.params, self.dtype)  # all a rank keeps of the weights
        self.units, self.unit_of = [], {}
        for name, module, params in self._unit_params:
            start = self.offset_of[params[0]]
            end = start + sum(p.numel() for p in params)
            unit = Unit(name, module, params, start, end, self.dtype, self.device)
            for param in params:
                self.unit_of[param] = unit
                offset = self.offset_of[param] - start
                param.data = unit.buffer[offset:offset + param.numel()].view_as(param)
            self.units.append(unit)
            self._free(unit)  # the original full tensors are released here
        for module in model.modules():  # modules outside a unit that use its parameters (a tied lm_head)
            for param in module.parameters(recurse=False):
                unit = self.unit_of.get(param)
                if unit and all(module is not m for m in unit.module.modules()) and module not in unit.users:
                    unit.users.append(module)
        for unit in self.units:
            for module in unit.users:
                module.register_forward_pre_hook(lambda module, args, unit=unit: self._gather(unit))
                module.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))
        self.peak_gathered_bytes = 0

    def _flat_order(self, model: nn.Module) -> list[nn.Parameter]:
        """Unit by unit, so that each unit is one contiguous range of the flat vector."""
        self._unit_params, order = [], []
        for name, module in self._unit_modules:
            params = [p for p in module.parameters() if p.requires_grad and all(p is not q for q in order)]
            if params:
                self._unit_params.append((name, module, params))
                order += params
        names = {p: n for n, p in model.named_parameters()}
        loose = [names[p] for p in model.parameters() if p.requires_grad and all(p is not q for q in order)]
        if loose:
            raise ValueError(f"parameters {loose} belong to no ZeRO-3 unit; pass units=[(name, module), ...] "
                             "covering every trainable parameter")
        return order

    # ------------------------------------------------------------------------------ gather and free
    def _gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        unit.buffer.untyped_storage().resize_(unit.nbytes)  # allocate again; the views see the new memory
        for owner, (lo, hi) in enumerate(self.layout.pieces(unit.start, unit.end)):
            if hi > lo:
                piece = unit.buffer[lo - unit.start:hi - unit.start]
                if owner == self.rank:
                    piece.copy_(self.param_shard[lo - self.layout.start:hi - self.layout.start])
                src = owner if self.group is None else dist.get_global_rank(self.group, owner)
                dist.broadcast(piece, src=src, group=self.group)
        self.comm_volume["all_gather"] += unit.end - unit.start
        unit.gathered = True
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _free(self, unit: Unit) -> None:
        unit.buffer.untyped_storage().resize_(0)
        unit.gathered = False

    def _after_forward(self, unit: Unit, output) -> None:
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:  # fires when the output's gradient is ready: the unit's backward is next
                    tensor.register_hook(lambda grad, unit=unit: self._gather(unit))
        self._free(unit)

    def gathered_bytes(self) -> int:
        """Bytes of full parameters gathered on this rank right now."""
        return sum(unit.nbytes for unit in self.units if unit.gathered)

    # ------------------------------------------------------------------------------ gradients and the step
    def _grad_ready(self, param: nn.Parameter) -> None:
        super()._grad_ready(param)  # reduce-scatter into the gradient shard, free .grad
        unit = self.unit_of[param]
        if all(p in self.ready for p in unit.params):
            self._free(unit)

    def update(self, grad: torch.Tensor) -> None:
        """AdamW on the shard. No all-gather: the next forward gathers each unit when it needs it."""
        if self.master is not None:
            self.adam.step(self.master, grad)
            self.param_shard.copy_(self.master)
        else:
            self.adam.step(self.param_shard, grad)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().state_tensors()
        tensors["params"] = [self.param_shard]
        return tensors

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> full parameter, all-gathered from the shards (a collective: call it on every rank)."""
        full = torch.empty(self.layout.shard_numel * self.layout.parts, dtype=self.dtype, device=self.device)
        all_gather_single(full, self.param_shard, group=self.group)
        return {self.names[p]: full[o:o + p.numel()].view(p.shape).clone() for p, o in
                zip(self.params, self.layout.offsets)}


def apply_zero(model, stage: int, **kwargs) -> ZeroOptimizer:
    """Shard `model`'s training state with ZeRO `stage` (0-3); kwargs as ZeroOptimizer (lr, weight_decay, ...).

    Stage 3 changes the model in place: its parameters then hold data only between the forward pre-hook
    that gathers them and the hook that frees them (see course_lib.sharding.zero3).
    """
    if stage == 3:
        return Zero3Optimizer(model, **kwargs)
    return ZeroOptimizer(model, stage, **kwargs)

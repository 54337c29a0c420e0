"""The grading pipeline: notebooks/ is a fresh, byte-stable release of solutions/ without solutions or
hidden tests, and grading is sound: for every graded exercise, plausible wrong answers and one cheat of
each kind lose its points, a right answer written differently from the reference keeps them, the
solutions score full marks and the untouched release zero.

    .venv/bin/python -m pytest -q tests/course/test_grading.py

Each graded notebook is a GradedNotebook below with, per exercise (named by its solution cell): at least
three plausible wrong answers (edits of the solution), a delegation (the answer hands the work to
course_lib or to `super()`), and a right answer written differently. The other cheats are built from an
exercise's first wrong answer: `changing the checks` (it rebinds torch.testing.assert_close,
math.isclose, and the course_lib function the hidden tests compare with, `library.MLP = MLP`),
`changing the kernel` (it registers an IPython AST transformer that wraps every later cell in
try/except) and `lying objects` (its result compares equal to anything). A notebook with autograded
cells but no entry fails test_every_graded_notebook_declares_its_mutants.

How it runs: every mutant is graded against its own exercise only, by course_tools.grading.grade (the step
nbgrader's autograde runs, see nbgrader_config.py), all mutants of a notebook in one grading sandbox (one
start-up, one forked check per mutant), with each notebook's solutions (full marks) and untouched release (zero).
nbgrader itself then autogrades, for the notebooks of NBGRADED, side by side in two scratch courses: the
solutions and a mixed submission (each exercise but the last given a mutant of another kind, the kinds rotating
from notebook to notebook so that every kind goes through nbgrader, with a kernel-changing cell added outside the
answers), and one untouched release, which checks the whole pipeline: scores per cell, in the gradebook, and the
feedback page. Nothing is written into the repository.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grading  # scripts/ is on sys.path (tests/conftest.py)
import nbformat
import pytest

from course_tools.grading import grade, read_exercises, without_markers

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO_ROOT / "solutions").glob("*/*.ipynb"))
SCRATCH_COURSES = 2  # graded side by side

WrongAnswers = dict[str, tuple[str, str, list[tuple[str, str]]]]
"""name -> (solution cell, test cell that must lose its points, [(text of the solution, wrong text), ...])."""

CHEAT_KINDS = ("delegation", "changing the checks", "changing the kernel", "lying objects", "patching through an alias",
               "code loaded at run time")
REFUSED_KINDS = ("delegation", "changing the checks", "changing the kernel", "lying objects", "patching through an alias")
"""Refused by the audit before they run; code loaded at run time passes it and fails the integrity snapshot."""
MIN_WRONG_ANSWERS = 3

CHECKS_CHEAT = {  # setup name -> the line that disarms what the tests use from it
    "torch": "torch.testing.assert_close = lambda *args, **kwargs: None",
    "math": "math.isclose = lambda *args, **kwargs: True",
}
ALIAS_CHEAT = """

import math as _math
import torch as _torch

_torch.testing.assert_close = lambda *args, **kwargs: None
_math.isclose = lambda *args, **kwargs: True
"""
RUNTIME_CHEAT = '''

import os as _os
import tempfile as _tempfile

import torch as _torch

_folder = _tempfile.mkdtemp()
with open(_os.path.join(_folder, "hubconf.py"), "w") as _file:
    _file.write("import math\\nimport torch\\n\\ntorch.testing.assert_close = lambda *args, **kwargs: None\\n"
                "math.isclose = lambda *args, **kwargs: True\\n\\n\\ndef entry():\\n    return 0\\n")
_torch.hub.load(_folder, "entry", source="local")
'''
KERNEL_CHEAT = """

import ast as _ast


class _PassEverything(_ast.NodeTransformer):
    def visit_Module(self, node):
        handler = _ast.ExceptHandler(type=_ast.Name("BaseException", _ast.Load()), name=None, body=[_ast.Pass()])
        node.body = [_ast.Try(body=node.body, handlers=[handler], orelse=[], finalbody=[])]
        return _ast.fix_missing_locations(node)


get_ipython().ast_transformers.append(_PassEverything())
"""
LYING_CLASSES = """

class AlwaysEqual(list):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False
"""


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (the table is a dict)
class GradedNotebook:
    """A notebook with autograded cells, its plausible wrong answers, delegations and right answers written
    differently (the last two by solution cell)."""

    assignment: str
    name: str
    wrong_answers: WrongAnswers
    delegations: dict[str, str] = field(default_factory=dict)
    alternatives: dict[str, str] = field(default_factory=dict)
    more_delegations: dict[str, list[str]] = field(default_factory=dict)   # delegations the audit must know by name
    more_alternatives: dict[str, list[str]] = field(default_factory=dict)  # idioms a right answer may use

    @property
    def source(self) -> Path:
        return REPO_ROOT / "solutions" / self.assignment / f"{self.name}.ipynb"

    @property
    def student_version(self) -> Path:
        return REPO_ROOT / "notebooks" / self.assignment / f"{self.name}.ipynb"

    def __str__(self) -> str:
        return f"{self.assignment}/{self.name}"


# Exercise 3's tests run with the library's rotate_half, so exercise 2's mistakes cost only exercise 2.
MODEL_FROM_SCRATCH = GradedNotebook("session_a", "02_model_from_scratch", {
    "rmsnorm_eps_outside_the_root": ("ex1_rmsnorm", "ex1_rmsnorm_tests", [
        ("torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)",
         "1 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)")]),
    "rmsnorm_subtracts_the_mean": ("ex1_rmsnorm", "ex1_rmsnorm_tests", [
        ("x32 = x.float()", "x32 = x.float() - x.float().mean(-1, keepdim=True)")]),
    "rotate_half_along_the_first_dim": ("ex2_rotate_half", "ex2_rotate_half_tests", [
        ("half = x.shape[-1] // 2", "half = x.shape[0] // 2"),
        ("x1, x2 = x[..., :half], x[..., half:]", "x1, x2 = x[:half], x[half:]"),
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((-x2, x1), dim=0)")]),
    "rotate_half_wrong_half_negated": ("ex2_rotate_half", "ex2_rotate_half_tests", [
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((x2, -x1), dim=-1)")]),
    "rope_keys_not_rotated": ("ex3_rope", "ex3_rope_tests", [
        ("k_rotated = k * cos + rotate_half(k) * sin", "k_rotated = k")]),
    "rope_cos_and_sin_swapped": ("ex3_rope", "ex3_rope_tests", [
        ("q * cos + rotate_half(q) * sin", "q * sin + rotate_half(q) * cos"),
        ("k * cos + rotate_half(k) * sin", "k * sin + rotate_half(k) * cos")]),
    "mlp_silu_on_the_up_branch": ("ex4_mlp", "ex4_mlp_tests", [
        ("F.silu(self.gate_proj(x)) * self.up_proj(x)", "self.gate_proj(x) * F.silu(self.up_proj(x))")]),
    "attention_without_sqrt_d": ("ex5_attention", "ex5_attention_tests", [
        ("(q @ k.transpose(-2, -1)) / math.sqrt(head_dim)", "q @ k.transpose(-2, -1)")]),
    "attention_without_mask": ("ex5_attention", "ex5_attention_tests", [
        ('scores = scores.masked_fill(~causal_mask, float("-inf"))', "")]),
    "attention_mask_off_by_one": ("ex5_attention", "ex5_attention_tests", [
        (".tril()", ".tril(1)")]),
    "init_residual_scale_without_the_2": ("ex6_init", "ex6_init_tests", [
        ("(2 * self.config.n_layer) ** -0.5", "self.config.n_layer ** -0.5")]),
    "loss_without_the_shift": ("ex7_forward", "ex7_forward_tests", [
        ("logits[:, :-1, :].reshape(-1, logits.size(-1))", "logits.reshape(-1, logits.size(-1))"),
        ("targets[:, 1:].reshape(-1)", "targets.reshape(-1)")]),
    "forward_without_the_final_norm": ("ex7_forward", "ex7_forward_tests", [
        ("self.lm_head(self.norm_f(x))", "self.lm_head(x)")]),
    "forward_without_checkpointing": ("ex7_forward", "ex7_forward_tests", [
        ("            if self.config.activation_checkpointing and self.training:\n"
         "                x = checkpoint(block, x, cos, sin, use_reentrant=False)\n"
         "            else:\n"
         "                x = block(x, cos, sin)",
         "            x = block(x, cos, sin)")]),
    "rmsnorm_without_the_weight": ("ex1_rmsnorm", "ex1_rmsnorm_tests", [
        ("return normed.type_as(x) * self.weight", "return normed.type_as(x)")]),
    "rotate_half_without_the_minus": ("ex2_rotate_half", "ex2_rotate_half_tests", [
        ("torch.cat((-x2, x1), dim=-1)", "torch.cat((x2, x1), dim=-1)")]),
    "rope_q_rotated_with_k": ("ex3_rope", "ex3_rope_tests", [
        ("q * cos + rotate_half(q) * sin", "q * cos + rotate_half(k) * sin")]),
    "mlp_gelu_instead_of_silu": ("ex4_mlp", "ex4_mlp_tests", [
        ("F.silu(self.gate_proj(x))", "F.gelu(self.gate_proj(x))")]),
    "mlp_branches_added": ("ex4_mlp", "ex4_mlp_tests", [
        ("F.silu(self.gate_proj(x)) * self.up_proj(x)", "F.silu(self.gate_proj(x)) + self.up_proj(x)")]),
    "init_embedding_skipped": ("ex6_init", "ex6_init_tests", [
        ("        elif isinstance(module, nn.Embedding):\n            nn.init.normal_(module.weight, mean=0.0, std=0.02)",
         "")]),
    "init_bias_kept": ("ex6_init", "ex6_init_tests", [
        ("            if module.bias is not None:\n                nn.init.zeros_(module.bias)\n", "")]),
}, delegations={
    "ex1_rmsnorm": """\
class RMSNorm(library.RMSNorm):
    pass
""",
    "ex2_rotate_half": """\
def rotate_half(x):
    return library.rotate_half(x)
""",
    "ex3_rope": """\
def apply_rotary_pos_emb(q, k, cos, sin):
    return library.apply_rotary_pos_emb(q, k, cos, sin)
""",
    "ex4_mlp": """\
MLP = library.MLP
""",
    "ex5_attention": """\
def causal_attention(q, k, v, dropout_p: float = 0.0, training: bool = False):
    return library.causal_attention(q, k, v, dropout_p, training)
""",
    "ex6_init": """\
class GPTInit(GPT):
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
""",
    "ex7_forward": """\
class MyGPT(GPT):
    def forward(self, idx, targets=None):
        return super().forward(idx, targets)
""",
}, alternatives={
    "ex1_rmsnorm": """\
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_float = x.to(torch.float32)
        variance = x_float.square().mean(dim=-1, keepdim=True)
        return (x_float / torch.sqrt(variance + self.eps)).to(x.dtype) * self.weight
""",
    "ex2_rotate_half": """\
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
""",
    "ex3_rope": """\
def apply_rotary_pos_emb(q, k, cos, sin):
    def rotate(t):
        return t * cos + rotate_half(t) * sin
    return rotate(q), rotate(k)
""",
    "ex4_mlp": """\
class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)
        self.down_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        gate = F.silu(self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x))
""",
    "ex5_attention": """\
def causal_attention(q, k, v, dropout_p: float = 0.0, training: bool = False):
    T = q.size(-2)
    scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    if training and dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v
""",
    "ex6_init": """\
class GPTInit(GPT):
    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if isinstance(module, nn.Linear) and getattr(module, "RESIDUAL_SCALE_INIT", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            torch.nn.init.normal_(module.weight, 0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)
""",
    "ex7_forward": """\
class MyGPT(GPT):
    def forward(self, idx, targets=None):
        cos, sin = self.rope(idx.size(1))
        h = self.emb_dropout(self.tok_emb(idx))
        for block in self.blocks:
            if self.training and self.config.activation_checkpointing:
                h = checkpoint(block, h, cos, sin, use_reentrant=False)
            else:
                h = block(h, cos, sin)
        logits = self.lm_head(self.norm_f(h))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets[:, 1:].flatten())
        return logits, loss
""",
})

# Exercise 10's tests use the library's optimizer and schedule; the distributed tests run on real ranks.
TRAINER_EXERCISES = GradedNotebook("session_b", "05_trainer_exercises", {
    "optimizer_decay_chosen_by_name": ("ex8_optimizer", "ex8_optimizer_tests", [
        ("if param.dim() >= 2:", 'if "norm" not in name:')]),
    "optimizer_norms_decayed": ("ex8_optimizer", "ex8_optimizer_tests", [
        ("            no_decay.append(param)", "            decay.append(param)")]),
    "optimizer_tied_weight_listed_twice": ("ex8_optimizer", "ex8_optimizer_tests", [
        ("    for name, param in model.named_parameters():",
         "    for module in model.modules():\n"
         "      for name, param in module.named_parameters(recurse=False):")]),
    "lr_warmup_starts_at_zero": ("ex9_get_lr", "ex9_get_lr_tests", [
        ("max_lr * (step + 1) / warmup_steps", "max_lr * step / warmup_steps")]),
    "lr_cosine_decays_to_zero": ("ex9_get_lr", "ex9_get_lr_tests", [
        ("min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)",
         "0.5 * (1.0 + math.cos(math.pi * progress)) * max_lr")]),
    "lr_progress_over_max_steps": ("ex9_get_lr", "ex9_get_lr_tests", [
        ("(step - warmup_steps) / (max_steps - warmup_steps)", "(step - warmup_steps) / max_steps")]),
    "step_loss_not_divided": ("ex10_train_step", "ex10_train_step_tests", [
        ("(loss / n).backward()", "loss.backward()")]),
    "step_no_sync_on_the_last_micro_batch": ("ex10_train_step", "ex10_train_step_tests", [
        ("no_sync() if no_sync is not None and i < n - 1 else nullcontext()",
         "no_sync() if no_sync is not None else nullcontext()")]),
    "step_zero_grad_before_step": ("ex10_train_step", "ex10_train_step_tests", [
        ("    optimizer.step()\n"
         "    if scheduler is not None:\n"
         "        scheduler.step()\n"
         "    optimizer.zero_grad(set_to_none=True)\n",
         "    optimizer.zero_grad(set_to_none=True)\n"
         "    optimizer.step()\n"
         "    if scheduler is not None:\n"
         "        scheduler.step()\n")]),
    "checkpoint_optimizer_not_restored": ("ex11_checkpoint", "ex11_checkpoint_tests", [
        ('    optimizer.load_state_dict(state["optimizer"])\n', "")]),
    "checkpoint_saves_the_ddp_wrapper": ("ex11_checkpoint", "ex11_checkpoint_tests", [
        ('    if hasattr(model, "module"):  # DistributedDataParallel: save the model inside, without "module." '
         'in the keys\n        model = model.module\n', "")]),
    "checkpoint_written_in_place": ("ex11_checkpoint", "ex11_checkpoint_tests", [
        ('    tmp = path.with_name(path.name + ".tmp")\n'
         "    torch.save(state, tmp)\n"
         "    os.replace(tmp, path)  # the old checkpoint stays whole until the new one is complete",
         "    torch.save(state, path)")]),
    "scaler_steps_on_overflow": ("amp1_scaled_step", "amp1_scaled_step_tests", [
        ('        state["growth_tracker"] = 0\n        return False\n    optimizer.step()',
         '        state["growth_tracker"] = 0\n    optimizer.step()')]),
    "scaler_count_kept_on_overflow": ("amp1_scaled_step", "amp1_scaled_step_tests", [
        ('        state["growth_tracker"] = 0\n        return False', "        return False")]),
    "scaler_misses_nan": ("amp1_scaled_step", "amp1_scaled_step_tests", [
        ("if not torch.isfinite(param.grad).all():", "if torch.isinf(param.grad).any():")]),
    "scaler_count_kept_after_growth": ("amp1_scaled_step", "amp1_scaled_step_tests", [
        ('        state["growth_tracker"] = 0\n    return True', "    return True")]),
    "average_sums_without_dividing": ("dp1_average_gradients", "dp1_average_gradients_tests", [
        ("            param.grad /= world_size\n", "")]),
    "average_reduces_the_loss": ("dp1_average_gradients", "dp1_average_gradients_tests", [
        ("    loss.backward()\n"
         "    world_size = dist.get_world_size()\n"
         "    for param in model.parameters():\n"
         "        if param.grad is not None:\n"
         "            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n"
         "            param.grad /= world_size\n",
         "    dist.all_reduce(loss, op=dist.ReduceOp.SUM)\n"
         "    (loss / dist.get_world_size()).backward()\n")]),
    "average_frozen_parameters_not_skipped": ("dp1_average_gradients", "dp1_average_gradients_tests", [
        ("        if param.grad is not None:\n"
         "            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n"
         "            param.grad /= world_size\n",
         "        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n"
         "        param.grad /= world_size\n")]),
    "shard_contiguous_blocks": ("dp2_shard_indices", "dp2_shard_indices_tests", [
        ("indices[rank::world_size]", "indices[rank * per_rank:(rank + 1) * per_rank]")]),
    "shard_without_padding": ("dp2_shard_indices", "dp2_shard_indices_tests", [
        ("    indices += (indices * math.ceil(padding / num_samples))[:padding]  # pad by repeating the permutation\n",
         "")]),
    "shard_padding_repeats_the_start_once": ("dp2_shard_indices", "dp2_shard_indices_tests", [
        ("(indices * math.ceil(padding / num_samples))[:padding]", "indices[:padding]")]),
    "shard_epoch_ignored": ("dp2_shard_indices", "dp2_shard_indices_tests", [
        ("manual_seed(seed + epoch)", "manual_seed(seed)")]),
}, delegations={
    "amp1_scaled_step": """\
def scaled_step(optimizer, state: dict) -> bool:
    scaler = torch.amp.GradScaler("cpu", init_scale=state["scale"], growth_factor=state["growth_factor"],
                                  backoff_factor=state["backoff_factor"], growth_interval=state["growth_interval"])
    scaler.step(optimizer)
    scaler.update()
    stepped = scaler.get_scale() >= state["scale"]
    state["scale"] = scaler.get_scale()
    return stepped
""",
    "ex8_optimizer": """\
def configure_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95)):
    return library_optim.configure_optimizer(model, lr=lr, weight_decay=weight_decay, betas=betas)
""",
    "ex9_get_lr": """\
def get_lr(step, *, max_lr, min_lr, warmup_steps, max_steps):
    return library_optim.get_lr(step, max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup_steps, max_steps=max_steps)
""",
    "ex10_train_step": """\
def train_step(model, micro_batches, optimizer, scheduler=None, *, grad_clip=None, no_sync=None):
    return library_steps.train_step(model, micro_batches, optimizer, scheduler, grad_clip=grad_clip, no_sync=no_sync)
""",
    "ex11_checkpoint": """\
from course_lib.checkpoint.atomic import save_checkpoint, load_checkpoint
""",
    "dp1_average_gradients": """\
def data_parallel_backward(model, idx):
    from course_lib.data_parallel.ddp import allreduce_gradients
    _, loss = model(idx, targets=idx)
    loss.backward()
    allreduce_gradients(model)
    return loss.detach()
""",
    "dp2_shard_indices": """\
def shard_indices(num_samples, rank, world_size, *, seed=0, epoch=0):
    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)
""",
}, alternatives={
    "amp1_scaled_step": """\
def scaled_step(optimizer, state):
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for grad in grads:
        grad.div_(state["scale"])
    overflow = any(bool((~torch.isfinite(grad)).any()) for grad in grads)
    if overflow:
        state["scale"] = state["scale"] * state["backoff_factor"]
        state["growth_tracker"] = 0
    else:
        optimizer.step()
        state["growth_tracker"] = (state["growth_tracker"] + 1) % state["growth_interval"]
        if state["growth_tracker"] == 0:
            state["scale"] = state["scale"] * state["growth_factor"]
    return not overflow
""",
    "ex8_optimizer": """\
def configure_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95)):
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)
""",
    "ex9_get_lr": """\
def get_lr(step, *, max_lr, min_lr, warmup_steps, max_steps):
    if step < warmup_steps:
        return (step + 1) / warmup_steps * max_lr
    if step >= max_steps:
        return min_lr
    cosine = math.cos(math.pi * (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr + (max_lr - min_lr) * (1 + cosine) / 2
""",
    "ex10_train_step": """\
def train_step(model, micro_batches, optimizer, scheduler=None, *, grad_clip=None, no_sync=None):
    lr = optimizer.param_groups[0]["lr"]
    losses = []
    last = len(micro_batches) - 1
    for i, idx in enumerate(micro_batches):
        context = no_sync() if (no_sync is not None and i != last) else nullcontext()
        with context:
            loss = model(idx, targets=idx)[1]
            (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": torch.stack(losses).mean().item(), "grad_norm": float(grad_norm), "lr": lr}
""",
    "dp1_average_gradients": """\
def data_parallel_backward(model, idx):
    loss = model(idx, targets=idx)[1]
    loss.backward()
    for grad in [p.grad for p in model.parameters() if p.grad is not None]:
        dist.all_reduce(grad)
        grad.div_(dist.get_world_size())
    return loss.detach()
""",
    "dp2_shard_indices": """\
def shard_indices(num_samples, rank, world_size, *, seed=0, epoch=0):
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(num_samples, generator=generator).tolist()
    total = -(-num_samples // world_size) * world_size
    padded = (order * (total // num_samples + 1))[:total]
    return [padded[i] for i in range(rank, total, world_size)]
""",
    "ex11_checkpoint": """\
def save_checkpoint(path, model, optimizer, step):
    plain = model.module if hasattr(model, "module") else model
    path = Path(path)
    partial = path.parent / (path.name + ".partial")
    torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
    partial.replace(path)


def load_checkpoint(path, model, optimizer):
    state = torch.load(path, map_location="cpu", weights_only=True)
    (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]
""",
}, more_delegations={
    "dp1_average_gradients": ["""\
def data_parallel_backward(model, idx):
    from torch.nn.parallel import DistributedDataParallel

    replica = DistributedDataParallel(model)
    _, loss = replica(idx, targets=idx)
    loss.backward()
    return loss.detach()
"""],
    "amp1_scaled_step": ["""\
def scaled_step(optimizer, state):
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    found_inf, scale = torch.zeros(1), torch.full((1,), float(state["scale"]))
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale.reciprocal())
    tracker = torch.full((1,), state["growth_tracker"], dtype=torch.int32)
    torch._amp_update_scale_(scale, tracker, found_inf, state["growth_factor"], state["backoff_factor"],
                             state["growth_interval"])
    stepped = not bool(found_inf.item())
    if stepped:
        optimizer.step()
    state["scale"], state["growth_tracker"] = scale.item(), int(tracker.item())
    return stepped
"""],
}, more_alternatives={
    "dp1_average_gradients": ["""\
def data_parallel_backward(model, idx):
    _, loss = model(idx, targets=idx)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    packed = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for every gradient, as DDP's buckets do
    dist.all_reduce(packed)
    packed /= dist.get_world_size()
    for grad, part in zip(grads, packed.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))
    return loss.detach()
"""],
})

# DDP exercises 1-3 (session B, notebook 02b): every test starts 3 ranks (exercise 3 also 2).
DDP_EXERCISES = GradedNotebook("session_b", "02b_ddp_exercises", {
    "overlap_not_divided": ("ddp1_overlap", "ddp1_overlap_tests", [
        ("            param.grad /= world_size\n", "")]),
    "overlap_pending_not_cleared": ("ddp1_overlap", "ddp1_overlap_tests", [
        ("        pending.clear()\n", "")]),
    "overlap_blocking_all_reduce": ("ddp1_overlap", "ddp1_overlap_tests", [
        ("        pending.append((param, dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)))",
         "        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n        pending.append((param, None))"),
        ("            work.wait()\n", "            if work is not None:\n                work.wait()\n")]),
    "overlap_frozen_parameters_hooked": ("ddp1_overlap", "ddp1_overlap_tests", [
        ("        if param.requires_grad:\n            param.register_post_accumulate_grad_hook(launch_all_reduce)",
         "        param.register_post_accumulate_grad_hook(launch_all_reduce)")]),
    "buckets_in_forward_order": ("ddp2_buckets", "ddp2_buckets_tests", [
        ("for param in reversed([p for p in model.parameters() if p.requires_grad]):",
         "for param in [p for p in model.parameters() if p.requires_grad]:")]),
    "buckets_not_divided": ("ddp2_buckets", "ddp2_buckets_tests", [
        ("            flat /= world_size\n", "")]),
    "buckets_counts_not_reset": ("ddp2_buckets", "ddp2_buckets_tests", [
        ("        for i in range(len(ready)):\n            ready[i] = 0\n", "")]),
    "buckets_cap_read_as_bytes": ("ddp2_buckets", "ddp2_buckets_tests", [
        ("cap_bytes = int(bucket_cap_mb * 2**20)", "cap_bytes = bucket_cap_mb")]),
    "buckets_closed_before_the_cap": ("ddp2_buckets", "ddp2_buckets_tests", [
        ("""        current.append(param)
        size += param.numel() * param.element_size()
        if size >= cap_bytes:  # this parameter took the bucket to the cap or past it: close it
            buckets.append(current)
            current, size = [], 0
""", """        nbytes = param.numel() * param.element_size()
        if current and size + nbytes > cap_bytes:  # the next parameter would pass the cap: close first
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += nbytes
""")]),
    "buckets_last_one_dropped": ("ddp2_buckets", "ddp2_buckets_tests", [
        ("    if current:\n        buckets.append(current)\n", "")]),
    "ring_all_gather_with_the_reduce_indices": ("ddp3_ring", "ddp3_ring_tests", [
        ("send_index, recv_index = (rank + 1 - step) % world_size, (rank - step) % world_size",
         "send_index, recv_index = (rank - step) % world_size, (rank - step - 1) % world_size")]),
    "ring_all_gather_adds": ("ddp3_ring", "ddp3_ring_tests", [
        ("chunks[recv_index].copy_(exchange(send_index, recv_index))",
         "chunks[recv_index].add_(exchange(send_index, recv_index))")]),
    "ring_chunk_instead_of_tensor_split": ("ddp3_ring", "ddp3_ring_tests", [
        ("torch.tensor_split(tensor.view(-1), world_size)", "tensor.view(-1).chunk(world_size)")]),
    "ring_passes_whole_tensors": ("ddp3_ring", "ddp3_ring_tests", [
        ("""    chunks = list(torch.tensor_split(tensor.view(-1), world_size))  # views into tensor
""", """    flat = tensor.view(-1)
    total, passing = flat.clone(), flat.clone()
    for step in range(world_size - 1):  # pass every rank's tensor once around the ring
        incoming = torch.empty_like(passing)
        request = dist.isend(passing, dst=right)
        dist.recv(incoming, src=left)
        request.wait()
        total += incoming
        passing = incoming
    flat.copy_(total)
    return tensor
    chunks = list(torch.tensor_split(tensor.view(-1), world_size))  # views into tensor
""")]),
    "ring_sum_by_another_name_and_messages_for_show": ("ddp3_ring", "ddp3_ring_tests", [
        ("""    chunks = list(torch.tensor_split(tensor.view(-1), world_size))  # views into tensor
""", """    from torch.distributed import distributed_c10d

    distributed_c10d.all_reduce(tensor)  # dist.all_reduce by another name
    for step in range(2 * (world_size - 1)):  # and the ring's 2(n - 1) messages, sent for show
        request = dist.isend(tensor.view(-1)[:1].clone(), dst=right)
        dist.recv(torch.empty(1), src=left)
        request.wait()
    return tensor
    chunks = list(torch.tensor_split(tensor.view(-1), world_size))  # views into tensor
""")]),
}, delegations={
    "ddp1_overlap": """\
def overlapped_gradient_sync(model):
    from course_lib.data_parallel.ddp import BucketedDataParallel

    return BucketedDataParallel(model, bucket_cap_mb=1e-9, broadcast=False).finish_gradient_sync
""",
    "ddp2_buckets": """\
def bucketed_gradient_sync(model, bucket_cap_mb):
    from course_lib.data_parallel.ddp import BucketedDataParallel

    return BucketedDataParallel(model, bucket_cap_mb, broadcast=False).finish_gradient_sync
""",
    "ddp3_ring": """\
def ring_all_reduce(tensor):
    from course_lib.data_parallel.collectives import ring_all_reduce as ring

    return ring(tensor)
""",
}, alternatives={
    "ddp1_overlap": """\
def overlapped_gradient_sync(model):
    handles = {}

    def hook(param):
        handles[param] = dist.all_reduce(param.grad, async_op=True)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)

    def finish():
        n = dist.get_world_size()
        while handles:
            param, work = handles.popitem()
            work.wait()
            param.grad.div_(n)

    return finish
""",
    "ddp2_buckets": """\
def bucketed_gradient_sync(model, bucket_cap_mb):
    limit = int(bucket_cap_mb * 1024 * 1024)
    buckets = []
    for param in reversed(list(model.parameters())):
        if not param.requires_grad:
            continue
        if not buckets or buckets[-1]["bytes"] >= limit:  # the last bucket reached the limit: it is closed
            buckets.append({"params": [], "bytes": 0, "ready": 0, "work": None, "flat": None})
        buckets[-1]["params"].append(param)
        buckets[-1]["bytes"] += param.numel() * param.element_size()

    def make_hook(bucket):
        def hook(param):
            bucket["ready"] += 1
            if bucket["ready"] == len(bucket["params"]):
                bucket["flat"] = torch.cat([p.grad.flatten() for p in bucket["params"]])
                bucket["work"] = dist.all_reduce(bucket["flat"], async_op=True)
        return hook

    for bucket in buckets:
        hook = make_hook(bucket)
        for param in bucket["params"]:
            param.register_post_accumulate_grad_hook(hook)

    def finish():
        world_size = dist.get_world_size()
        for bucket in buckets:
            if bucket["work"] is None:
                continue
            bucket["work"].wait()
            averaged = bucket["flat"] / world_size
            for p, piece in zip(bucket["params"], averaged.split([p.numel() for p in bucket["params"]])):
                p.grad.copy_(piece.view_as(p.grad))
            bucket["ready"], bucket["work"], bucket["flat"] = 0, None, None

    return finish
""",
    "ddp3_ring": """\
def ring_all_reduce(tensor):
    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return tensor
    pieces = torch.tensor_split(tensor.view(-1), n)
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            if phase == "reduce-scatter":
                out, into = (me - s) % n, (me - s - 1) % n
            else:
                out, into = (me - s + 1) % n, (me - s) % n
            buffer = torch.zeros_like(pieces[into])
            request = dist.isend(pieces[out].clone(), (me + 1) % n)
            dist.recv(buffer, (me - 1) % n)
            request.wait()
            if phase == "reduce-scatter":
                pieces[into].add_(buffer)
            else:
                pieces[into].copy_(buffer)
    return tensor
""",
})

# Exercise 3's tests run with the library's expand_nodelist, so exercise 2's mistakes cost only exercise 2.
CLUSTER_EXERCISES = GradedNotebook("session_c", "02_cluster_exercises", {
    "node_rank_one_based": ("cl1_node_rank_range", "cl1_node_rank_range_tests", [
        ("first = node_rank * nproc_per_node", "first = (node_rank - 1) * nproc_per_node")]),
    "node_rank_range_end_inclusive": ("cl1_node_rank_range", "cl1_node_rank_range_tests", [
        ("range(first, first + nproc_per_node)", "range(first, first + nproc_per_node + 1)")]),
    "node_rank_not_checked_against_nnodes": ("cl1_node_rank_range", "cl1_node_rank_range_tests", [
        ("if node_rank < 0 or (nnodes is not None and node_rank >= nnodes):", "if node_rank < 0:")]),
    "nodelist_split_on_every_comma": ("cl2_expand_nodelist", "cl2_expand_nodelist_tests", [
        ("for pattern in split_outside_brackets(nodelist):", 'for pattern in nodelist.split(","):')]),
    "nodelist_zero_padding_lost": ("cl2_expand_nodelist", "cl2_expand_nodelist_tests", [
        ("str(n).zfill(len(low))", "str(n)")]),
    "nodelist_padding_from_the_high_end": ("cl2_expand_nodelist", "cl2_expand_nodelist_tests", [
        ("str(n).zfill(len(low))", "str(n).zfill(len(high))")]),
    "master_addr_last_host": ("cl3_slurm_to_torch_env", "cl3_slurm_to_torch_env_tests", [
        ('environ.get("MASTER_ADDR") or hosts[0]', 'environ.get("MASTER_ADDR") or hosts[-1]')]),
    "local_rank_from_procid": ("cl3_slurm_to_torch_env", "cl3_slurm_to_torch_env_tests", [
        ('"LOCAL_RANK": require("SLURM_LOCALID")', '"LOCAL_RANK": require("SLURM_PROCID")')]),
    "master_port_ignores_job_id": ("cl3_slurm_to_torch_env", "cl3_slurm_to_torch_env_tests", [
        ('29500 + int(environ.get("SLURM_JOB_ID", 0)) % 1000', "29500")]),
}, delegations={
    "cl1_node_rank_range": """\
def node_rank_range(node_rank, nproc_per_node, nnodes=None):
    return library.node_rank_range(node_rank, nproc_per_node, nnodes)
""",
    "cl2_expand_nodelist": """\
expand_nodelist = library.expand_nodelist
""",
    "cl3_slurm_to_torch_env": """\
def slurm_to_torch_env(environ, master_port=None):
    return library.slurm_to_torch_env(environ, master_port)
""",
}, alternatives={
    "cl3_slurm_to_torch_env": """\
def slurm_to_torch_env(environ, master_port=None):
    def get(name):
        if name not in environ:
            raise KeyError(f"{name} is not set: run this inside srun")
        return environ[name]

    hosts = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or get("SLURM_NODELIST"))
    ntasks = int(get("SLURM_NTASKS"))
    node = int(get("SLURM_NODEID"))
    if not 0 <= node < len(hosts):
        raise ValueError(f"SLURM_NODEID={node} is not one of the {len(hosts)} hosts")
    if "SLURM_TASKS_PER_NODE" in environ:
        per_node = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])[node]
    else:
        per_node = ntasks // len(hosts)
    if master_port is None:
        master_port = environ.get("MASTER_PORT") or 29500 + int(environ.get("SLURM_JOB_ID", 0)) % 1000
    return {"RANK": get("SLURM_PROCID"), "LOCAL_RANK": get("SLURM_LOCALID"), "WORLD_SIZE": str(ntasks),
            "LOCAL_WORLD_SIZE": str(per_node), "NODE_RANK": str(node), "NNODES": str(len(hosts)),
            "MASTER_ADDR": environ.get("MASTER_ADDR") or hosts[0], "MASTER_PORT": str(int(master_port))}
""",
    "cl1_node_rank_range": """\
def node_rank_range(node_rank, nproc_per_node, nnodes=None):
    if nproc_per_node <= 0:
        raise ValueError(f"nproc_per_node must be positive, got {nproc_per_node}")
    if node_rank < 0 or (nnodes is not None and not node_rank < nnodes):
        raise ValueError(f"there is no node {node_rank} in this job")
    return range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node)
""",
    "cl2_expand_nodelist": """\
def expand_nodelist(nodelist):
    patterns, depth, start = [], 0, 0
    for i, char in enumerate(nodelist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            if nodelist[start:i]:
                patterns.append(nodelist[start:i])
            start = i + 1
    hosts = []
    for pattern in patterns:
        expanded = [""]
        for piece in re.split(r"(\\[[^\\]]*\\])", pattern):
            if not piece:
                continue
            if piece.startswith("["):
                choices = []
                for item in piece[1:-1].split(","):
                    low, high = (item.split("-") + [item])[:2]
                    choices += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
            else:
                choices = [piece]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts += expanded
    return hosts
""",
})

# Job exercises 1-3 (session C, notebook 03b): every test starts 2-4 ranks.
JOB_EXERCISES = GradedNotebook("session_c", "03b_job_exercises", {
    "join_node_minor": ("job1_join", "job1_join_tests", [
        ("rank, world_size = node_rank * per_node + local_rank, nnodes * per_node",
         "rank, world_size = local_rank * nnodes + node_rank, nnodes * per_node")]),
    "join_world_is_the_node_count": ("job1_join", "job1_join_tests", [
        ("rank, world_size = node_rank * per_node + local_rank, nnodes * per_node",
         "rank, world_size = node_rank * per_node + local_rank, nnodes")]),
    "join_returns_the_local_rank": ("job1_join", "job1_join_tests", [
        ("    return rank, world_size", "    return local_rank, world_size")]),
    "ranked_manifest_before_the_barrier": ("job2_ranked", "job2_ranked_tests", [
        ("    dist.barrier()  # every shard is on disk before the manifest says the checkpoint is complete\n", "")]),
    "ranked_manifest_written_in_place": ("job2_ranked", "job2_ranked_tests", [
        ('        tmp = directory / "manifest.json.tmp"\n        tmp.write_text(json.dumps(manifest))\n'
         '        os.replace(tmp, directory / "manifest.json")',
         '        (directory / "manifest.json").write_text(json.dumps(manifest))')]),
    "ranked_every_rank_writes_everything": ("job2_ranked", "job2_ranked_tests", [
        ("torch.save(padded[rank * shard:(rank + 1) * shard].clone(),", "torch.save(flat.clone(),")]),
    "ranked_shard_saved_as_a_view": ("job2_ranked", "job2_ranked_tests", [
        ("torch.save(padded[rank * shard:(rank + 1) * shard].clone(),",
         "torch.save(padded[rank * shard:(rank + 1) * shard],")]),
    "ranked_without_padding": ("job2_ranked", "job2_ranked_tests", [
        ("    padded = torch.cat([flat, flat.new_zeros(shard * world_size - flat.numel())])\n",
         "    padded = flat\n")]),
    "eval_mean_over_batches": ("job3_eval", "job3_eval_tests", [
        ("totals += torch.tensor([loss.item() * tokens, tokens], dtype=torch.float64)",
         "totals += torch.tensor([loss.item(), 1.0], dtype=torch.float64)")]),
    "eval_in_training_mode": ("job3_eval", "job3_eval_tests", [
        ("    model.eval()\n", "")]),
    "eval_mode_not_restored": ("job3_eval", "job3_eval_tests", [
        ("    model.train(was_training)\n", "")]),
    "eval_counts_the_first_token": ("job3_eval", "job3_eval_tests", [
        ("tokens = idx[:, 1:].numel()", "tokens = idx.numel()")]),
}, delegations={
    "job1_join": """\
def join_job(environ):
    from course_lib.runtime.env import init_distributed

    info = init_distributed("gloo")
    return info.rank, info.world_size
""",
    "job2_ranked": """\
def save_ranked(directory, model, step):
    from course_lib.checkpoint.ranked import save_ranked_checkpoint

    save_ranked_checkpoint(directory, model, step=step)


def load_ranked(directory, model):
    from course_lib.checkpoint.ranked import load_ranked_checkpoint

    return load_ranked_checkpoint(directory, model, reshard=True)["step"]
""",
    "job3_eval": """\
def evaluate_on_ranks(model, batches):
    from course_lib.data_parallel.collectives import mean_over_ranks

    model.eval()
    with torch.no_grad():
        losses = [model(idx, targets=idx)[1].item() for idx in batches]
    return mean_over_ranks(sum(losses) / len(losses))
""",
}, alternatives={
    "job1_join": """\
def join_job(environ):
    def get(name):
        return int(environ[name])

    world_size = get("NNODES") * get("NPROC_PER_NODE")
    rank = get("LOCAL_RANK") + get("NPROC_PER_NODE") * get("NODE_RANK")
    store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=rank == 0)
    dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()
    return (dist.get_rank(), dist.get_world_size())
""",
    "job2_ranked": """\
def save_ranked(directory, model, step):
    import json
    import os
    from pathlib import Path

    folder = Path(directory)
    os.makedirs(folder, exist_ok=True)
    world, me = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    per_rank = -(-flat.numel() // world)
    flat = F.pad(flat, (0, per_rank * world - flat.numel()))
    torch.save(flat.split(per_rank)[me].clone(), folder / f"shard_{me:05d}.pt")
    dist.barrier()
    if me == 0:
        info = {"world_size": world, "step": step, "numel": sum(p.numel() for p in model.parameters()),
                "shapes": [list(p.shape) for p in model.parameters()]}
        with open(folder / "manifest.json.tmp", "w") as f:
            json.dump(info, f)
        os.replace(folder / "manifest.json.tmp", folder / "manifest.json")


def load_ranked(directory, model):
    import json
    from pathlib import Path

    folder = Path(directory)
    if not (folder / "manifest.json").exists():
        raise FileNotFoundError(f"no manifest.json in {folder}: the save never finished")
    info = json.loads((folder / "manifest.json").read_text())
    flat = torch.cat([torch.load(folder / f"shard_{r:05d}.pt") for r in range(info["world_size"])])
    sizes = [math.prod(shape) for shape in info["shapes"]]
    with torch.no_grad():
        for p, piece, shape in zip(model.parameters(), flat[:info["numel"]].split(sizes), info["shapes"]):
            p.copy_(piece.reshape(shape))
    return info["step"]
""",
    "job3_eval": """\
def evaluate_on_ranks(model, batches):
    mode = model.training
    model.train(False)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for idx in batches:
            n = idx.shape[0] * (idx.shape[1] - 1)
            loss_sum += float(model(idx, targets=idx)[1]) * n
            count += n
    both = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
    dist.all_reduce(both)
    model.train(mode)
    return float(both[0] / both[1])
""",
})

# ZeRO exercises 1-4 (session D, notebook 02b): exercises 2-4 start 2-4 ranks.
ZERO_EXERCISES = GradedNotebook("session_d", "02b_zero_exercises", {
    "bytes_without_padding": ("zero1_bytes", "zero1_bytes_tests", [
        ("shard = math.ceil(n_params / world_size)", "shard = n_params // world_size")]),
    "bytes_stage2_keeps_full_gradients": ("zero1_bytes", "zero1_bytes_tests", [
        ('"grads": grad_bytes * (shard if stage >= 2 else n_params)',
         '"grads": grad_bytes * (shard if stage >= 3 else n_params)')]),
    "bytes_mixed_optimizer_without_the_master": ("zero1_bytes", "zero1_bytes_tests", [
        ('"mixed": (2, 2, 12)', '"mixed": (2, 2, 8)')]),
    "bytes_stage1_shards_the_gradients": ("zero1_bytes", "zero1_bytes_tests", [
        ('"grads": grad_bytes * (shard if stage >= 2 else n_params)',
         '"grads": grad_bytes * (shard if stage >= 1 else n_params)')]),
    "zero1_gradient_all_reduced_by_another_name": ("zero2_stage1", "zero2_stage1_tests", [
        ("        reduce_scatter_single(grad, padded_flat([p.grad for p in params]), op=dist.ReduceOp.SUM)\n",
         "        from torch.distributed import distributed_c10d\n"
         "        summed = padded_flat([p.grad for p in params])\n"
         "        distributed_c10d.all_reduce(summed)  # the all-reduce ZeRO replaces, by another name\n"
         "        grad.copy_(summed[rank * shard:(rank + 1) * shard])\n")]),
    "zero1_gathered_behind_the_counters_back": ("zero2_stage1", "zero2_stage1_tests", [
        ("        all_gather_single(full, mine.detach())\n",
         "        from torch.distributed import distributed_c10d\n"
         "        distributed_c10d._get_default_group()._allgather_base(full, mine.detach()).wait()\n")]),
    "zero1_gradient_not_averaged": ("zero2_stage1", "zero2_stage1_tests", [
        ("        mine.grad = grad / world_size\n", "        mine.grad = grad\n")]),
    "zero1_optimizer_made_every_step": ("zero2_stage1", "zero2_stage1_tests", [
        ("    optimizer = torch.optim.SGD([mine], lr=lr, momentum=momentum)\n\n    def step():\n",
         "\n    def step():\n        optimizer = torch.optim.SGD([mine], lr=lr, momentum=momentum)\n")]),
    "zero1_padding_in_front": ("zero2_stage1", "zero2_stage1_tests", [
        ("        flat[:numel] = torch.cat(", "        flat[shard * world_size - numel:] = torch.cat(")]),
    "zero2_full_gradient_kept": ("zero3_stage2", "zero3_stage2_tests", [
        ("        for p in bucket:\n            p.grad = None  # the bucket's copy is all that is left of the full gradients\n",
         "")]),
    "zero2_gradient_shard_not_zeroed": ("zero3_stage2", "zero3_stage2_tests", [
        ("        mine.grad.zero_()\n", "")]),
    "zero2_received_not_averaged": ("zero3_stage2", "zero3_stage2_tests", [
        ("+= received / world_size", "+= received")]),
    "zero2_reduce_scatter_deferred_to_the_step": ("zero3_stage2", "zero3_stage2_tests", [
        ("        work = dist.reduce_scatter(received, [grad[a - start:b - start] for a, b in bounds], op=dist.ReduceOp.SUM,\n"
         "                                   async_op=True)\n        in_flight.append((work, received, lo, hi, grad))\n",
         "        in_flight.append((bounds, start, received, lo, hi, grad))\n"),
        ("        for work, received, lo, hi, _ in in_flight:\n            work.wait()\n",
         "        for bounds, start, received, lo, hi, grad in in_flight:\n"
         "            dist.reduce_scatter(received, [grad[a - start:b - start] for a, b in bounds], op=dist.ReduceOp.SUM)\n")]),
    "zero2_waits_in_the_hook": ("zero3_stage2", "zero3_stage2_tests", [
        ("                                   async_op=True)\n",
         "                                   async_op=True)\n        work.wait()  # as if it were blocking\n")]),
    "zero2_a_bucket_per_parameter": ("zero3_stage2", "zero3_stage2_tests", [
        ("        if sum(q.numel() for q in bucket) >= bucket_numel:\n", "        if True:\n")]),
    "zero3_no_prefetch": ("zero4_stage3", "zero4_stage3_tests", [
        ("            units[i].gather()\n            prefetch(i + 1)  # the next unit's gather runs while this one computes\n",
         "            units[i].gather()\n"),
        ("            units[i].gather()\n            prefetch(i - 1)\n", "            units[i].gather()\n")]),
    "zero3_prefetch_two_ahead": ("zero4_stage3", "zero4_stage3_tests", [
        ("            prefetch(i + 1)  # the next unit's gather runs while this one computes\n",
         "            prefetch(i + 1)\n            prefetch(i + 2)\n")]),
    "zero3_kept_after_forward": ("zero4_stage3", "zero4_stage3_tests", [
        ("        def after_forward(module, args, output):\n            units[i].free()\n",
         "        def after_forward(module, args, output):\n")]),
    "zero3_not_gathered_for_backward": ("zero4_stage3", "zero4_stage3_tests", [
        ("            if output.requires_grad:  # its gradient arrives just before this unit's backward runs\n"
         "                output.register_hook(before_backward)\n", "")]),
    "zero3_gradient_not_averaged": ("zero4_stage3", "zero4_stage3_tests", [
        ("            self.shard.grad += received / world_size\n", "            self.shard.grad += received\n")]),
    "zero3_freed_by_a_new_tensor": ("zero4_stage3", "zero4_stage3_tests", [
        ("            offset = 0\n            for p in self.params:  # each parameter keeps its shape, as a view into the buffer\n"
         "                p.data = self.full[offset:offset + p.numel()].view(p.shape)\n                offset += p.numel()\n",
         "            self.shapes = [p.shape for p in self.params]\n"),
        ("            self.full.untyped_storage().resize_(0)\n",
         "            for p in self.params:  # a new, empty tensor: autograd's saved views keep the old one\n"
         "                p.data = torch.empty(0)\n            self.full = None\n"),
        ("                self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())\n",
         "                self.full = torch.empty(self.size * world_size)\n"),
        ("                self.work.wait()\n                self.state, self.work = \"gathered\", None  # a finished work still holds its output\n",
         "                self.work.wait()\n                self.state, self.work = \"gathered\", None\n                offset = 0\n"
         "                for p, shape in zip(self.params, self.shapes):\n"
         "                    p.data = self.full[offset:offset + shape.numel()].view(shape)\n"
         "                    offset += shape.numel()\n")]),
}, delegations={
    "zero1_bytes": """\
def zero_bytes_per_rank(n_params, world_size, stage, precision="fp32"):
    from course_lib.sharding.model_states import expected_model_states

    expected = expected_model_states(n_params, world_size, stage, precision=precision)
    return {kind: expected[kind] for kind in ("params", "grads", "optimizer_states")}
""",
    "zero2_stage1": """\
def zero1_optimizer(model, lr, momentum=0.9):
    from course_lib.sharding import apply_zero

    return apply_zero(model, 1, lr=lr).step
""",
    "zero3_stage2": """\
def zero2_optimizer(model, lr, momentum=0.9):
    from course_lib.sharding import apply_zero

    return apply_zero(model, 2, lr=lr).step
""",
    "zero4_stage3": """\
def zero3_optimizer(model, lr, momentum=0.9):
    from course_lib.sharding import apply_zero

    return apply_zero(model, 3, lr=lr).step
""",
}, alternatives={
    "zero1_bytes": """\
def zero_bytes_per_rank(n_params, world_size, stage, precision="fp32"):
    owned = -(-n_params // world_size)
    if precision == "fp32":
        sizes = {"params": 4, "grads": 4, "optimizer_states": 8}
    else:
        sizes = {"params": 2, "grads": 2, "optimizer_states": 12}
    sharded_from = {"optimizer_states": 1, "grads": 2, "params": 3}
    return {kind: size * (owned if stage >= sharded_from[kind] else n_params) for kind, size in sizes.items()}
""",
    "zero2_stage1": """\
def zero1_optimizer(model, lr, momentum=0.9):
    n, r = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    per_rank = -(-total // n)

    def flat(tensors):
        return F.pad(torch.cat([t.flatten() for t in tensors]), (0, per_rank * n - total))

    shard = flat([p.detach() for p in params]).narrow(0, r * per_rank, per_rank).clone()
    shard.requires_grad_(True)
    sgd = torch.optim.SGD([shard], lr=lr, momentum=momentum)

    def step():
        g = torch.zeros(per_rank)
        dist.reduce_scatter_tensor(g, flat([p.grad for p in params]))
        shard.grad = g.div(n)
        sgd.step()
        gathered = torch.zeros(per_rank * n)
        dist.all_gather_into_tensor(gathered, shard.detach())
        with torch.no_grad():
            for p, piece in zip(params, gathered[:total].split([p.numel() for p in params])):
                p.copy_(piece.view_as(p))

    return step
""",
    "zero3_stage2": """\
def zero2_optimizer(model, lr, momentum=0.9, bucket_numel=20_000):
    n, me = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    S = -(-total // n)
    ends = torch.tensor([p.numel() for p in params]).cumsum(0).tolist()
    where = {p: (e - p.numel(), e) for p, e in zip(params, ends)}
    full = torch.cat([p.detach().flatten() for p in params] + [torch.zeros(S * n - total)])
    shard = full[me * S:(me + 1) * S].clone().requires_grad_(True)
    grad_shard = torch.zeros(S)
    sgd = torch.optim.SGD([shard], lr=lr, momentum=momentum)

    groups, group, size = [], [], 0
    for p in params[::-1]:
        group, size = group + [p], size + p.numel()
        if size >= bucket_numel:
            groups.append(group)
            group, size = [], 0
    groups += [group] if group else []
    home = {p: g for g, members in enumerate(groups) for p in members}
    done = {}
    works = []

    def send(members):
        lo_all, hi_all = where[members[-1]][0], where[members[0]][1]
        g = torch.cat([p.grad.flatten() for p in members[::-1]])
        pieces, mine = [], None
        for k in range(n):
            lo, hi = max(lo_all, k * S), min(hi_all, (k + 1) * S)
            pieces.append(g[lo - lo_all:hi - lo_all] if hi > lo else g[:0])
            if k == me:
                mine = (lo, max(lo, hi))
        out = torch.zeros(mine[1] - mine[0])
        works.append((dist.reduce_scatter(out, pieces, async_op=True), out, mine, g))
        for p in members:
            p.grad = None

    def hook(p):
        g = home[p]
        done[g] = done.get(g, 0) + 1
        if done[g] == len(groups[g]):
            del done[g]
            send(groups[g])

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def step():
        while works:
            work, out, (lo, hi), _ = works.pop(0)
            work.wait()
            if hi > lo:
                grad_shard[lo - me * S:hi - me * S] += out / n
        shard.grad = grad_shard.clone()
        sgd.step()
        grad_shard.zero_()
        gathered = torch.zeros(S * n)
        dist.all_gather_single(gathered, shard.detach())
        with torch.no_grad():
            for p in params:
                lo, hi = where[p]
                p.copy_(gathered[lo:hi].view_as(p))

    return step
""",
    "zero4_stage3": """\
def zero3_optimizer(model, lr, momentum=0.9):
    n, me = dist.get_world_size(), dist.get_rank()
    blocks = list(model)
    flats, shards, jobs = [], [], [None] * len(blocks)
    for block in blocks:
        ps = list(block.parameters())
        total = sum(p.numel() for p in ps)
        per = -(-total // n)
        flat = F.pad(torch.cat([p.detach().flatten() for p in ps]), (0, per * n - total))
        shards.append(flat.narrow(0, me * per, per).clone().requires_grad_(True))
        shards[-1].grad = torch.zeros(per)
        for p, piece in zip(ps, flat[:total].split([p.numel() for p in ps])):
            p.data = piece.view_as(p)
        flat.untyped_storage().resize_(0)
        flats.append(flat)
    sgd = torch.optim.SGD(shards, lr=lr, momentum=momentum)
    pending = {}

    def fetch(k, wait):
        if not 0 <= k < len(blocks):
            return
        storage = flats[k].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(flats[k].numel() * 4)
            jobs[k] = dist.all_gather_into_tensor(flats[k], shards[k].detach(), async_op=True)
        if wait and jobs[k] is not None:
            jobs[k].wait()
            jobs[k] = None

    def release(k):
        flats[k].untyped_storage().resize_(0)

    def on_grad(k, p):
        pending.setdefault(k, set()).add(p)
        ps = list(blocks[k].parameters())
        if len(pending[k]) < len(ps):
            return
        summed = F.pad(torch.cat([q.grad.flatten() for q in ps]), (0, flats[k].numel() - sum(q.numel() for q in ps)))
        mine = torch.zeros_like(shards[k])
        dist.reduce_scatter_tensor(mine, summed)
        shards[k].grad.add_(mine, alpha=1 / n)
        for q in ps:
            q.grad = None
        pending.pop(k)
        release(k)

    for k, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda mod, inp, k=k: (fetch(k, True), fetch(k + 1, False)) and None)
        block.register_full_backward_pre_hook(lambda mod, grad, k=k: (fetch(k, True), fetch(k - 1, False)) and None)
        block.register_forward_hook(lambda mod, inp, out, k=k: release(k))
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p, k=k: on_grad(k, p))

    def step():
        sgd.step()
        for shard in shards:
            shard.grad.zero_()

    return step
""",
})

# The debugging labs (session C, notebooks 06 and 07): 13 jobs, each a diagnosis (no ranks) and a fix run on 2 ranks.
# Wrong diagnoses change one field; wrong fixes are edits of the correct function, none of which hangs (a hang costs
# the timeout); the right answers written differently are edits too.
_LAB_ANSWERS = {  # job number -> (ranks, function, cause, the functions its fix rewrites)
    1: ("[0]", "train", "A", ("train",)), 2: ("[0]", "train", "A", ("train",)),
    3: ('"all"', "evaluate", "C", ("evaluate",)), 4: ('"all"', "make_loader", "D", ("make_loader",)),
    5: ("[0]", "train", "B", ("train",)), 6: ('"all"', "train", "H", ("train",)),
    7: ("[0]", "train", "L", ("train",)), 8: ('"all"', "JobModel", "G", ("JobModel",)),
    9: ('"all"', "train", "E", ("train",)), 10: ("[0]", "train", "F", ("train",)),
    11: ('"all"', "train_step", "I", ("train_step",)), 12: ('"all"', "train_step", "J", ("train_step",)),
    13: ('"all"', "train_step", "K", ("train_step",)),
}
_MEAN = "            global_loss = mean_over_ranks(loss, device)"
_EVAL = "                record[\"val_loss\"] = evaluate(model, val_windows, rank, world_size)"
_FINAL_SAVE = "    save_checkpoint(checkpoint, model, optimizer, step, rank)\n    final = build_model(config).to(device)"
_FINAL_LOAD = "    load_checkpoint(checkpoint, final, None)\n"
_SCALED = "            scaler.scale(loss / len(micro_batches)).backward()"
_HALF_THE_WINDOWS = [(_EVAL, _EVAL.replace("val_windows,", "val_windows[:6],"))]  # right steps, wrong held-out loss
_SYNCED_EVERY_MICRO_BATCH = [("with nullcontext() if last else model.no_sync():", "with nullcontext():")]
_LAB_WRONG_FIXES = {  # job -> [(name, [(text of the correct function, wrong text)])]; none waits for a timeout
    1: [("loss_not_averaged", [(_MEAN, "            global_loss = loss.item()")]),
        ("loss_summed", [(_MEAN, _MEAN + " * world_size")]),
        ("half_the_held_out_windows", _HALF_THE_WINDOWS)],
    2: [("half_the_held_out_windows", _HALF_THE_WINDOWS),
        ("the_checkpoint_not_reloaded", [(_FINAL_LOAD, "")]),
        ("each_rank_its_own_evaluation", [(_EVAL, _EVAL.replace("rank, world_size)", "rank, 1)"))])],
    3: [("mean_of_the_ranks_means", [("[loss.item() * len(mine), len(mine)]", "[loss.item(), 1]")]),
        ("no_all_reduce", [("    dist.all_reduce(totals)\n", "")]),
        ("a_window_left_out", [("mine = val_windows[rank::world_size]", "mine = val_windows[rank * 5:(rank + 1) * 5]")])],
    4: [("ranks_shuffled_differently", [("shuffle=True, seed=config.seed,", "shuffle=True, seed=config.seed + rank,")]),
        ("every_rank_reads_everything", [("num_replicas=world_size, rank=rank,", "num_replicas=1, rank=0,")]),
        ("padded_windows_read_twice", [("\n                                 drop_last=True)",
                                        "\n                                 drop_last=False)"),
                                       ("sampler=sampler, drop_last=True)", "sampler=sampler)")])],
    5: [("loss_not_averaged", [(_MEAN, "            global_loss = loss.item()")]),
        ("each_rank_its_own_evaluation", [(_EVAL, _EVAL.replace("rank, world_size)", "rank, 1)"))]),
        ("half_the_held_out_windows", _HALF_THE_WINDOWS)],
    6: [("the_wrapper_saved", [(_FINAL_SAVE, _FINAL_SAVE.replace("checkpoint, model,", "checkpoint, ddp,"))]),
        ("the_checkpoint_not_reloaded", [(_FINAL_LOAD, "")]),
        ("the_test_loss_of_another_model", [("    test_loss = evaluate(final, val_windows, rank, world_size)",
                                             "    test_loss = evaluate(build_model(config), val_windows, rank, world_size)")])],
    7: [("final_file_never_written", [("    load_checkpoint(checkpoint, final, None)", "    load_checkpoint(out_dir / \"final.pt\", final, None)")]),
        ("the_checkpoint_not_reloaded", [(_FINAL_LOAD, "")]),
        ("the_test_loss_of_another_model", [("    test_loss = evaluate(final, val_windows, rank, world_size)",
                                             "    test_loss = evaluate(build_model(config), val_windows, rank, world_size)")])],
    8: [("head_always_built", [("        if aux_loss_weight > 0:\n            self.aux_head", "        self.aux_head")]),
        ("aux_loss_unweighted", [("loss = loss + self.aux_loss_weight * aux", "loss = loss + aux")]),
        ("aux_head_with_a_bias", [("config.vocab_size, bias=False)", "config.vocab_size, bias=True)")])],
    9: [("epoch_never_set", [("        sampler.set_epoch(epoch)\n", "")]),
        ("epoch_off_by_one", [("sampler.set_epoch(epoch)", "sampler.set_epoch(epoch + 1)")]),
        ("half_the_held_out_windows", _HALF_THE_WINDOWS)],
    10: [("optimizer_state_not_restored", [("step = load_checkpoint(checkpoint, model, optimizer)",
                                            "step = load_checkpoint(checkpoint, model, None)")]),
         ("step_count_not_restored", [("step = load_checkpoint(checkpoint, model, optimizer)",
                                       "load_checkpoint(checkpoint, model, optimizer)")]),
         ("half_the_held_out_windows", _HALF_THE_WINDOWS)],
    11: [("synced_every_micro_batch", [("with nullcontext() if last else model.no_sync():", "with nullcontext():")]),
         ("the_last_micro_batch_not_synced", [("nullcontext() if last else model.no_sync()",
                                               "model.no_sync() if last else nullcontext()")]),
         ("synced_on_the_first", [("last = i == len(micro_batches) - 1", "last = i == 0")])],
    12: [("divided_by_the_ranks_too", [(_SCALED, _SCALED.replace("len(micro_batches))", "(len(micro_batches) * dist.get_world_size()))"))]),
         ("synced_every_micro_batch", _SYNCED_EVERY_MICRO_BATCH),
         ("logged_loss_summed", [("total += loss.detach().float() / len(micro_batches)", "total += loss.detach().float()")])],
    13: [("not_divided", [(_SCALED, "            scaler.scale(loss).backward()")]),
         ("synced_every_micro_batch", _SYNCED_EVERY_MICRO_BATCH),
         ("clipped_at_four", [("clip_grad_norm_(model.parameters(), 1.0)", "clip_grad_norm_(model.parameters(), 4.0)")])],
}
_LAB_ALTERNATIVE_FIXES = {  # job -> [(text of the correct function, another right way to write it)]
    1: [(_MEAN, "            summed = torch.tensor([loss.item()], dtype=torch.float64, device=device)\n"
                "            dist.all_reduce(summed, op=dist.ReduceOp.SUM)\n"
                "            global_loss = summed.item() / world_size")],
    2: [("            if step % config.eval_every == 0:\n" + _EVAL,
         "            evaluating = step % config.eval_every == 0\n            if evaluating:\n" + _EVAL)],
    3: [("    totals = torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64, device=mine.device)\n"
         "    dist.all_reduce(totals)\n    return (totals[0] / totals[1]).item()",
         "    total = torch.tensor([loss.item() * mine.shape[0]], dtype=torch.float64, device=mine.device)\n"
         "    count = torch.tensor([float(mine.shape[0])], dtype=torch.float64, device=mine.device)\n"
         "    dist.all_reduce(total)\n    dist.all_reduce(count)\n    return total.item() / count.item()")],
    4: [("    loader = DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True)",
         "    loader = DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True, num_workers=0)")],
    5: [(_EVAL, "                val_loss = evaluate(model, val_windows, rank, world_size)\n"
                "                record[\"val_loss\"] = val_loss")],
    6: [(_FINAL_SAVE, _FINAL_SAVE.replace("checkpoint, model,", "checkpoint, ddp.module,"))],
    7: [(_FINAL_SAVE, _FINAL_SAVE + "\n    dist.barrier()  # once more: nobody reads before everyone has seen it")],
    8: [("        if aux_loss_weight > 0:\n            self.aux_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)",
         "        self.aux_head = (torch.nn.Linear(config.n_embd, config.vocab_size, bias=False) if aux_loss_weight > 0\n"
         "                         else None)")],
    9: [("        sampler.set_epoch(epoch)\n        micro_batches = []", "        micro_batches = []\n        sampler.set_epoch(epoch)")],
    10: [("        step = load_checkpoint(checkpoint, model, optimizer)",
          "        state = torch.load(checkpoint, map_location=device, weights_only=True)\n"
          "        model.load_state_dict(state[\"model\"])\n        optimizer.load_state_dict(state[\"optimizer\"])\n"
          "        step = state[\"step\"]")],
    11: [("        with nullcontext() if last else model.no_sync():", "        with (model.no_sync() if not last else nullcontext()):")],
    12: [(_SCALED, "            scaler.scale(loss.div(len(micro_batches))).backward()")],
    13: [(_SCALED, "            scaler.scale(loss * (1.0 / len(micro_batches))).backward()")],
}


_LAB_MORE_FIXES = {  # job -> [edits of the correct functions]: more right answers, one idiom each
    8: [[("        if aux_loss_weight > 0:\n            self.aux_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)",
          "        self.aux_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)\n"
          "        self.aux_head.requires_grad_(aux_loss_weight > 0)  # frozen when unused: DDP waits for no gradient of it")]],
}


def _fix_answer(job: int, edits=()) -> str:
    """The correct functions of job `job` (train_job.py's), with edits, as an answer cell writes them."""
    from course_lib.debugging import train_job

    names = _LAB_ANSWERS[job][3]
    code = "\n\n".join(inspect.getsource(getattr(train_job, name)).rstrip() for name in names)
    for old, new in edits:
        assert code.count(old) == 1, f"job {job}: {old!r} is not once in the correct functions"
        code = code.replace(old, new)
    return f"# your function(s), then fixes_{job} = [...]\n{code}\n\n\nfixes_{job} = [{', '.join(names)}]"


def _lab_notebook(name: str, jobs: range) -> GradedNotebook:
    wrong, delegations, alternatives = {}, {}, {}
    for n in jobs:
        ranks, function, cause, names = _LAB_ANSWERS[n]
        right = f'diagnosis_{n} = {{"ranks": {ranks}, "function": "{function}", "cause": "{cause}"}}'
        other_cause = "A" if cause != "A" else "B"
        other_ranks = '"all"' if ranks != '"all"' else "[0]"
        other_function = "mean_over_ranks" if function != "mean_over_ranks" else "train"
        for label, old, new in (("cause", f'"cause": "{cause}"', f'"cause": "{other_cause}"'),
                                ("ranks", f'"ranks": {ranks}', f'"ranks": {other_ranks}'),
                                ("function", f'"function": "{function}"', f'"function": "{other_function}"')):
            wrong[f"job{n}_diagnosis_wrong_{label}"] = (f"dbg{n}_diagnosis", f"dbg{n}_diagnosis_tests", [(old, new)])
        delegations[f"dbg{n}_diagnosis"] = f"from course_lib.debugging import jobs\n\n{right}\n"
        ranks_value = '"all"' if ranks == '"all"' else "(0,)"
        alternatives[f"dbg{n}_diagnosis"] = f'diagnosis_{n} = dict(cause="{cause}", function="{function}", ranks={ranks_value})\n'
        for label, edits in _LAB_WRONG_FIXES[n]:
            wrong[f"job{n}_fix_{label}"] = (f"dbg{n}_fix", f"dbg{n}_fix_tests", edits)
        imported = ", ".join(names)
        delegations[f"dbg{n}_fix"] = f"from course_lib.debugging.train_job import {imported}\n\nfixes_{n} = [{imported}]\n"
        alternatives[f"dbg{n}_fix"] = _fix_answer(n, _LAB_ALTERNATIVE_FIXES[n])
    more = {f"dbg{n}_fix": [_fix_answer(n, edits) for edits in _LAB_MORE_FIXES[n]] for n in jobs if n in _LAB_MORE_FIXES}
    return GradedNotebook("session_c", name, wrong, delegations=delegations, alternatives=alternatives,
                          more_alternatives=more)


DEBUGGING_LAB = _lab_notebook("06_debugging_lab", range(1, 9))
DEBUGGING_LAB_SILENT = _lab_notebook("07_debugging_lab_silent", range(9, 14))

# Exercises 12-15b (session D). The tests of 12 start 4 ranks, of 14 and 15 2 ranks, of 15b 2 then 4 (hidden: 2 then 3).
SHARDING_EXERCISES = GradedNotebook("session_d", "04_sharding_exercises", {
    "no_padding_in_params": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("params += padded_rows * row_bytes", "params += held_rows * row_bytes")]),
    "moments_padded": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("moments += 2 * held_rows * row_bytes", "moments += 2 * padded_rows * row_bytes")]),
    "hybrid_shards_over_all_ranks": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ('"HYBRID_SHARD": ranks_per_node}', '"HYBRID_SHARD": world_size}')]),
    "shard_index_is_the_rank": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("index = rank % group", "index = rank")]),
    "step_counters_forgotten": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("step_counters = 4 * len(shapes)", "step_counters = 0")]),
    "rows_floored": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("padded_rows = math.ceil(shape[0] / group)", "padded_rows = shape[0] // group")]),
    "empty_shards_negative": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("held_rows = max(0, min(padded_rows, shape[0] - index * padded_rows))",
         "held_rows = min(padded_rows, shape[0] - index * padded_rows)")]),
    "bytes_per_element_ignored": ("ex12_rank_bytes", "ex12_rank_bytes_tests", [
        ("row_bytes = math.prod(shape[1:]) * bytes_per_element", "row_bytes = math.prod(shape[1:]) * 4")]),
    "reduce_in_low_precision": ("ex13_policy", "ex13_policy_tests", [
        ("reduce_dtype=torch.float32)", "reduce_dtype=compute_dtypes[precision])")]),
    "fp16_computes_in_bf16": ("ex13_policy", "ex13_policy_tests", [
        ('"fp16": torch.float16', '"fp16": torch.bfloat16')]),
    "unknown_precision_not_checked": ("ex13_policy", "ex13_policy_tests", [
        ("    if precision not in compute_dtypes:\n"
         '        raise ValueError(f"unknown precision {precision!r}; choose one of {list(compute_dtypes)}")\n', "")]),
    "only_the_root_wrapped": ("ex14_wrapping", "ex14_wrapping_tests", [
        ("    for block in model.blocks:\n        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n", "")]),
    "blocks_without_the_kwargs": ("ex14_wrapping", "ex14_wrapping_tests", [
        ("fully_shard(block, mesh=mesh, **fsdp_kwargs)", "fully_shard(block, mesh=mesh)")]),
    "root_not_wrapped": ("ex14_wrapping", "ex14_wrapping_tests", [
        ("    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n", "")]),
    "checkpoint_written_in_place": ("ex15_checkpoint", "ex15_checkpoint_tests", [
        ('        tmp = f"{path}.tmp"\n'
         '        torch.save({"model": state, "step": step}, tmp)\n'
         "        os.replace(tmp, path)  # the old checkpoint stays whole until the new one is complete\n",
         '        torch.save({"model": state, "step": step}, path)\n')]),
    "checkpoint_written_by_every_rank": ("ex15_checkpoint", "ex15_checkpoint_tests", [
        ("    if dist.get_rank() == 0:  # the other ranks received an empty dict\n"
         '        tmp = f"{path}.tmp"\n'
         '        torch.save({"model": state, "step": step}, tmp)\n'
         "        os.replace(tmp, path)",
         '    tmp = f"{path}.tmp"\n'
         '    torch.save({"model": state, "step": step}, tmp)\n'
         "    os.replace(tmp, path)")]),
    "checkpoint_of_the_local_shards": ("ex15_checkpoint", "ex15_checkpoint_tests", [
        ("state = get_model_state_dict(model, options=options)", "state = model.state_dict()")]),
    "dcp_loaded_without_the_model_key": ("ex15_checkpoint", "ex15_checkpoint_tests", [
        ('    state = {"model": model.state_dict()}', "    state = model.state_dict()"),
        ('model.load_state_dict(state["model"])', "model.load_state_dict(state)")]),
    "optimizer_not_saved": ("ex15b_reshard", "ex15b_reshard_tests", [
        ('dcp.save({"model": model_state, "optimizer": optimizer_state, "step": step}',
         'dcp.save({"model": model_state, "step": step}'),
        ('state = {"model": model_state, "optimizer": optimizer_state, "step": -1}',
         'state = {"model": model_state, "step": -1}'),
        ('set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])',
         'model.load_state_dict(state["model"])')]),
    "positional_optimizer_state": ("ex15b_reshard", "ex15b_reshard_tests", [
        ("get_state_dict(model, optimizer)\n    dcp.save(", "model.state_dict(), optimizer.state_dict()\n    dcp.save("),
        ("get_state_dict(model, optimizer)\n    state = {", "model.state_dict(), optimizer.state_dict()\n    state = {"),
        ('set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])',
         'model.load_state_dict(state["model"])\n    optimizer.load_state_dict(state["optimizer"])')]),
    "step_kept_as_a_tensor": ("ex15b_reshard", "ex15b_reshard_tests", [
        ('"step": step}', '"step": torch.tensor(step)}'),
        ('"step": -1}', '"step": torch.tensor(-1)}')]),
}, delegations={
    "ex12_rank_bytes": """\
def fsdp_rank_bytes(shapes, strategy, world_size, rank, ranks_per_node, bytes_per_element=4):
    holder = nn.Module()
    holder.params = nn.ParameterList([torch.empty(shape, device="meta") for shape in shapes])
    return library_fsdp.expected_fsdp_model_states(holder, world_size, rank, strategy=strategy,
                                                   ranks_per_node=ranks_per_node)
""",
    "ex15b_reshard": """\
from course_lib.checkpoint.fsdp import save_sharded_checkpoint, load_sharded_checkpoint


def save_sharded(model, optimizer, directory, step):
    save_sharded_checkpoint(directory, model=model, optimizer=optimizer)


def load_sharded(model, optimizer, directory):
    load_sharded_checkpoint(directory, model=model, optimizer=optimizer)
    return 2
""",
    "ex13_policy": """\
def mixed_precision_policy(precision):
    return library_fsdp.mixed_precision_policy(precision)
""",
    "ex14_wrapping": """\
def apply_fsdp(model, mesh, **fsdp_kwargs):
    return library_fsdp.apply_fsdp(model, mesh=mesh, **fsdp_kwargs)
""",
    "ex15_checkpoint": """\
from course_lib.checkpoint.fsdp import save_full_checkpoint, load_sharded_checkpoint
""",
}, alternatives={
    "ex15_checkpoint": """\
def save_full_checkpoint(model, path, step):
    import os
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    partial = str(path) + ".partial"
    torch.save({"step": step, "model": state}, partial)
    os.replace(partial, path)


def load_sharded_checkpoint(directory, model):
    import torch.distributed.checkpoint as dcp

    wanted = {"model": dict(model.state_dict())}
    dcp.load(wanted, checkpoint_id=str(directory), no_dist=True)
    model.load_state_dict(wanted["model"])
    return model
""",
    "ex12_rank_bytes": """\
def fsdp_rank_bytes(shapes, strategy, world_size, rank, ranks_per_node, bytes_per_element=4):
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        shard_group = world_size
    elif strategy == "HYBRID_SHARD":
        shard_group = ranks_per_node
    elif strategy == "NO_SHARD":
        shard_group = 1
    else:
        raise ValueError(f"strategy must be FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD, not {strategy!r}")
    me = rank - (rank // shard_group) * shard_group
    stored = held = 0
    for shape in shapes:
        per_row = bytes_per_element
        for size in shape[1:]:
            per_row *= size
        chunk = -(-shape[0] // shard_group)
        first = me * chunk
        stored += chunk * per_row
        held += (min(shape[0], first + chunk) - first) * per_row if first < shape[0] else 0
    out = {"params": stored, "grads": stored, "optimizer_states": 2 * held + 4 * len(shapes)}
    out["total"] = sum(out.values())
    return out
""",
    "ex15b_reshard": """\
def save_sharded(model, optimizer, directory, step):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"step": step, "weights": get_model_state_dict(model),
              "adamw": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory)


def load_sharded(model, optimizer, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    wanted = {"step": 0, "weights": get_model_state_dict(model), "adamw": get_optimizer_state_dict(model, optimizer)}
    dcp.load(wanted, checkpoint_id=directory)
    set_model_state_dict(model, wanted["weights"])
    set_optimizer_state_dict(model, optimizer, wanted["adamw"])
    return int(wanted["step"])
""",
    "ex13_policy": """\
def mixed_precision_policy(precision):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        raise ValueError(f"unknown precision {precision!r}")
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
""",
    "ex14_wrapping": """\
def apply_fsdp(model, mesh, **fsdp_kwargs):
    from torch.distributed.fsdp import fully_shard
    blocks = list(model.blocks)
    for i in range(len(blocks)):
        fully_shard(blocks[i], mesh=mesh, **fsdp_kwargs)
    return fully_shard(model, mesh=mesh, **fsdp_kwargs)
""",
})

# Model-parallel exercises 1-3 (session E, notebook 02b): f and g, a tensor-parallel block (2 and 4 ranks), and 1F1B
# simulated then trained on 2 ranks.
MODEL_PARALLEL_EXERCISES = GradedNotebook("session_e", "02b_model_parallel_exercises", {
    "regions_swapped": ("mp1_regions", "mp1_regions_tests", [
        ("    return CopyToParallelRegion.apply, ReduceFromParallelRegion.apply",
         "    return ReduceFromParallelRegion.apply, CopyToParallelRegion.apply")]),
    "f_backward_not_reduced": ("mp1_regions", "mp1_regions_tests", [
        ("            grad = grad.clone()\n            dist.all_reduce(grad, op=dist.ReduceOp.SUM)\n            return grad\n",
         "            return grad\n")]),
    "g_backward_reduces_too": ("mp1_regions", "mp1_regions_tests", [
        ("        @staticmethod\n        def backward(ctx, grad):\n            return grad",
         "        @staticmethod\n        def backward(ctx, grad):\n            grad = grad.clone()\n"
         "            dist.all_reduce(grad, op=dist.ReduceOp.SUM)\n            return grad")]),
    "g_backward_averages": ("mp1_regions", "mp1_regions_tests", [
        ("        @staticmethod\n        def backward(ctx, grad):\n            return grad",
         "        @staticmethod\n        def backward(ctx, grad):\n            grad = grad.clone()\n"
         "            dist.all_reduce(grad, op=dist.ReduceOp.SUM)\n            return grad / dist.get_world_size()")]),
    "block_f_on_every_projection": ("mp2_block", "mp2_block_tests", [
        ("    for region in (attn, mlp):\n        region.register_forward_pre_hook(lambda module, args: (f(args[0]), *args[1:]))",
         "    for projection in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):\n"
         "        projection.register_forward_pre_hook(lambda module, args: (f(args[0]), *args[1:]))")]),
    "block_o_proj_column_parallel": ("mp2_block", "mp2_block_tests", [
        ("    attn.o_proj = row(attn.o_proj)", "    attn.o_proj = column(attn.o_proj)")]),
    "block_no_g_after_the_mlp": ("mp2_block", "mp2_block_tests", [
        ("    for exit_layer in (attn.o_proj, mlp.down_proj):", "    for exit_layer in (attn.o_proj,):")]),
    "block_every_rank_keeps_the_first_rows": ("mp2_block", "mp2_block_tests", [
        ("part.weight.copy_(linear.weight[rank * out:(rank + 1) * out])", "part.weight.copy_(linear.weight[:out])")]),
    "warmup_one_too_many": ("mp3_1f1b", "mp3_1f1b_tests", [
        ("warmup = min(n_stages - stage - 1, micro_batches)", "warmup = min(n_stages - stage, micro_batches)")]),
    "warmup_not_capped": ("mp3_1f1b", "mp3_1f1b_tests", [
        ("warmup = min(n_stages - stage - 1, micro_batches)", "warmup = n_stages - stage - 1")]),
    "gpipe_instead": ("mp3_1f1b", "mp3_1f1b_tests", [
        ("warmup = min(n_stages - stage - 1, micro_batches)", "warmup = micro_batches")]),
    "cool_down_reversed": ("mp3_1f1b", "mp3_1f1b_tests", [
        ('[("B", i) for i in range(micro_batches - warmup, micro_batches)]',
         '[("B", i) for i in reversed(range(micro_batches - warmup, micro_batches))]')]),
    "stage_loop_blocking_sends": ("mp4_stage_loop", "mp4_stage_loop_tests", [
        ("sends.append(dist.isend(y.detach(), dst=rank + 1, tag=i))", "dist.send(y.detach(), dst=rank + 1, tag=i)"),
        ("sends.append(dist.isend(x.grad, dst=rank - 1, tag=i))", "dist.send(x.grad, dst=rank - 1, tag=i)")]),
    "stage_loop_loss_not_divided_by_m": ("mp4_stage_loop", "mp4_stage_loop_tests", [
        ("y = loss_fn(y, micro_batches[i]) / m\n                losses.append(y.item())",
         "y = loss_fn(y, micro_batches[i])\n                losses.append(y.item() / m)")]),
    "stage_loop_received_input_without_grad": ("mp4_stage_loop", "mp4_stage_loop_tests", [
        ("                dist.recv(x, src=rank - 1, tag=i)\n                x.requires_grad_()\n",
         "                dist.recv(x, src=rank - 1, tag=i)\n")]),
    "stage_loop_gradients_to_the_first_stage": ("mp4_stage_loop", "mp4_stage_loop_tests", [
        ("sends.append(dist.isend(x.grad, dst=rank - 1, tag=i))", "sends.append(dist.isend(x.grad, dst=0, tag=i))")]),
    "stage_loop_every_forward_first": ("mp4_stage_loop", "mp4_stage_loop_tests", [
        ("    for kind, i in actions:", '    for kind, i in sorted(actions, key=lambda action: action[0] == "B"):')]),
}, delegations={
    "mp2_block": """\
def parallelize_block(block, f, g):
    from course_lib.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(block)
""",
    "mp1_regions": """\
def megatron_f_and_g():
    from course_lib.tensor_parallel.tp_layers import copy_to_parallel_region, reduce_from_parallel_region

    return copy_to_parallel_region, reduce_from_parallel_region
""",
    "mp3_1f1b": """\
def one_f_one_b(n_stages, stage, micro_batches):
    return SCHEDULES["1f1b"](n_stages, stage, micro_batches)
""",
    "mp4_stage_loop": """\
def run_stage(stage, actions, micro_batches, hidden_shape, loss_fn):
    from course_lib.pipeline_parallel import PipelineRunner

    runner = PipelineRunner(stage, "1f1b", len(micro_batches))
    return runner.step(torch.cat(micro_batches))
""",
}, alternatives={
    "mp2_block": """\
def parallelize_block(block, f, g):
    t, r = dist.get_world_size(), dist.get_rank()

    def split(linear, dim):
        weight = linear.weight.detach().chunk(t, dim=dim)[r].clone()
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight.data.copy_(weight)
        return layer

    a, m = block.attn, block.mlp
    a.q_proj = split(a.q_proj, 0)
    a.k_proj = split(a.k_proj, 0)
    a.v_proj = split(a.v_proj, 0)
    a.o_proj = split(a.o_proj, 1)
    m.gate_proj = split(m.gate_proj, 0)
    m.up_proj = split(m.up_proj, 0)
    m.down_proj = split(m.down_proj, 1)

    def enter(module, args):
        return (f(args[0]),) + tuple(args[1:])

    def leave(module, args, output):
        return g(output)

    a.register_forward_pre_hook(enter)
    m.register_forward_pre_hook(enter)
    a.o_proj.register_forward_hook(leave)
    m.down_proj.register_forward_hook(leave)
""",
    "mp1_regions": """\
def megatron_f_and_g():
    class Enter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.clone()

        @staticmethod
        def backward(ctx, grad_output):
            summed = grad_output.detach().clone()
            dist.all_reduce(summed)
            return summed

    class Leave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            total = tensor.detach().clone()
            dist.all_reduce(total)
            return total

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output.clone()

    def f(x):
        return Enter.apply(x)

    def g(x):
        return Leave.apply(x)

    return f, g
""",
    "mp4_stage_loop": """\
def run_stage(stage, actions, micro_batches, hidden_shape, loss_fn):
    # Megatron's way: a send goes out together with the next receive from the same neighbour, in one batch.
    me, size = dist.get_rank(), dist.get_world_size()
    before = me - 1 if me > 0 else None
    after = me + 1 if me + 1 < size else None
    held, total, waiting, later = {}, None, None, []  # waiting: a send (tensor, peer, tag) not posted yet

    def flush():
        nonlocal waiting
        if waiting is not None:
            later.extend(dist.batch_isend_irecv([dist.P2POp(dist.isend, waiting[0], waiting[1], tag=waiting[2])]))
            waiting = None

    def exchange(peer, tag):
        nonlocal waiting
        ops = []
        if waiting is not None and waiting[1] == peer:
            ops.append(dist.P2POp(dist.isend, waiting[0], waiting[1], tag=waiting[2]))
            waiting = None
        flush()
        buffer = torch.zeros(hidden_shape)
        ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=tag))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return buffer

    for kind, index in actions:
        if kind == "F":
            source = micro_batches[index] if before is None else exchange(before, 2 * index).requires_grad_()
            result = stage(source)
            if after is None:
                result = loss_fn(result, micro_batches[index]) / len(micro_batches)
                total = result.detach() if total is None else total + result.detach()
            else:
                flush()
                waiting = (result.detach(), after, 2 * index)
            held[index] = (source, result)
        else:
            source, result = held.pop(index)
            if after is None:
                result.backward()
            else:
                result.backward(exchange(after, 2 * index + 1))
            if before is not None:
                flush()
                waiting = (source.grad, before, 2 * index + 1)
    flush()
    for work in later:
        work.wait()
    return float(total) if after is None else None
""",
    "mp3_1f1b": """\
def one_f_one_b(n_stages, stage, micro_batches):
    schedule, next_forward, next_backward = [], 0, 0
    in_flight_limit = n_stages - stage
    while next_backward < micro_batches:
        if next_forward < micro_batches and next_forward - next_backward < in_flight_limit:
            schedule.append(("F", next_forward))
            next_forward += 1
        else:
            schedule.append(("B", next_backward))
            next_backward += 1
    return schedule
""",
}, more_alternatives={
    "mp2_block": ["""\
def parallelize_block(block, f, g):
    size, rank = dist.get_world_size(), dist.get_rank()
    for parent, names, dim in ((block.attn, ("q_proj", "k_proj", "v_proj"), 0), (block.attn, ("o_proj",), 1),
                               (block.mlp, ("gate_proj", "up_proj"), 0), (block.mlp, ("down_proj",), 1)):
        for name in names:  # swap each linear layer for its shard: module surgery as torchtitan does it
            weight = getattr(parent, name).weight.detach().chunk(size, dim=dim)[rank].clone()
            shard = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            with torch.no_grad():
                shard.weight.copy_(weight)
            setattr(parent, name, shard)
    for region, last in ((block.attn, block.attn.o_proj), (block.mlp, block.mlp.down_proj)):
        region.register_forward_pre_hook(lambda module, args: (f(args[0]), *args[1:]))
        last.register_forward_hook(lambda module, args, output: g(output))
"""],
})

# One pure-Python exercise; the lesson (03_3d_parallelism) uses course_lib.hybrid.layout, so only its points are at stake.
MESH_LAYOUT = GradedNotebook("session_e", "03b_3d_exercises", {
    "pipeline_varies_fastest": ("ex18_rank_groups", "ex18_rank_groups_tests", [
        ("        return (d * pp + p) * tp + t", "        return (d * tp + t) * pp + p"),
        ("        t = rank % tp\n        p = rank // tp % pp\n", "        p = rank % pp\n        t = rank // pp % tp\n")]),
    "data_and_tensor_swapped": ("ex18_rank_groups", "ex18_rank_groups_tests", [
        ("        return (d * pp + p) * tp + t", "        return (t * pp + p) * dp + d"),
        ("        t = rank % tp\n        p = rank // tp % pp\n        d = rank // (tp * pp)\n",
         "        d = rank % dp\n        p = rank // dp % pp\n        t = rank // (dp * pp)\n")]),
    "data_stride_tp_plus_pp": ("ex18_rank_groups", "ex18_rank_groups_tests", [
        ("d = rank // (tp * pp)", "d = rank // (tp + pp)")]),
    "pipeline_coordinate_modulo_dp": ("ex18_rank_groups", "ex18_rank_groups_tests", [
        ("p = rank // tp % pp", "p = rank // tp % dp")]),
}, delegations={
    "ex18_rank_groups": """\
def rank_groups(world_size, tp, pp):
    return library.rank_groups(world_size, tp=tp, pp=pp)
""",
}, alternatives={
    "ex18_rank_groups": """\
def rank_groups(world_size, tp, pp):
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not divisible by tp * pp = {tp * pp}")
    dp = world_size // (tp * pp)
    places = []
    for rank in range(world_size):
        d, rest = divmod(rank, tp * pp)
        p, t = divmod(rest, tp)
        places.append(RankPlace(rank=rank, dp=d, pp=p, tp=t,
                                dp_group=[i * tp * pp + p * tp + t for i in range(dp)],
                                pp_group=[d * tp * pp + i * tp + t for i in range(pp)],
                                tp_group=[d * tp * pp + p * tp + i for i in range(tp)]))
    return places
""",
})

# Exercise 17's tests use the library's LoRALinear, so exercise 16's mistakes cost only exercise 16.
LORA_FINETUNING = GradedNotebook("session_e", "04b_lora_exercises", {
    "lora_forward_without_scaling": ("ex16_lora_forward", "ex16_lora_forward_tests", [
        ("self.base(x) + self.scaling * update", "self.base(x) + update")]),
    "lora_forward_a_and_b_swapped": ("ex16_lora_forward", "ex16_lora_forward_tests", [
        ("self.lora_B(self.lora_A(self.dropout(x)))", "self.lora_A(self.lora_B(self.dropout(x)))")]),
    "lora_forward_dropout_on_the_base_too": ("ex16_lora_forward", "ex16_lora_forward_tests", [
        ("update = self.lora_B(self.lora_A(self.dropout(x)))",
         "x = self.dropout(x)\n        update = self.lora_B(self.lora_A(x))")]),
    "lora_merge_without_scaling": ("ex17_lora_merge", "ex17_lora_merge_tests", [
        ("base.weight + layer.scaling * (layer.lora_B.weight @ layer.lora_A.weight)",
         "base.weight + layer.lora_B.weight @ layer.lora_A.weight")]),
    "lora_merge_into_the_base_in_place": ("ex17_lora_merge", "ex17_lora_merge_tests", [
        ("    merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)\n",
         "    merged = base\n")]),
    "lora_merge_copy_not_returned": ("ex17_lora_merge", "ex17_lora_merge_tests", [
        ("    return merged", "    return base")]),
}, delegations={
    "ex16_lora_forward": """\
LoRALinear = library_lora.LoRALinear
""",
    "ex17_lora_merge": """\
def merge_lora_linear(layer):
    return library_lora.merge_lora_linear(layer)
""",
}, alternatives={
    "ex16_lora_forward": """\
class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        low_rank = self.lora_A(self.dropout(x))
        return self.base(x) + self.lora_B(low_rank) * (self.alpha / self.r)
""",
    "ex17_lora_merge": """\
def merge_lora_linear(layer):
    base = layer.base
    merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
    delta = (layer.lora_B.weight @ layer.lora_A.weight) * (layer.alpha / layer.r)
    merged.weight.data = (base.weight.detach() + delta.detach()).clone()
    if base.bias is not None:
        merged.bias.data = base.bias.detach().clone()
    return merged
""",
}, more_delegations={
    "ex17_lora_merge": ["""\
def merge_lora_linear(layer):
    return layer.merge()
"""],
})

LONG_CONTEXT_EXERCISES = GradedNotebook("session_f", "01b_long_context_exercises", {
    "sp_enter_backward_not_summed": ("sp_regions", "sp_regions_tests", [
        ("        @staticmethod\n        def backward(ctx, grad):\n            return reduce_scatter(grad)\n",
         "        @staticmethod\n        def backward(ctx, grad):  # keep my positions\n"
         "            n = grad.shape[1] // dist.get_world_size()\n"
         "            return grad[:, dist.get_rank() * n:(dist.get_rank() + 1) * n]\n")]),
    "sp_gathered_along_the_batch": ("sp_regions", "sp_regions_tests", [
        ("        local = x.movedim(1, 0).contiguous()\n", "        local = x.contiguous()\n"),
        ("        return out.movedim(0, 1)\n\n    def reduce_scatter", "        return out\n\n    def reduce_scatter")]),
    "sp_leave_backward_not_gathered": ("sp_regions", "sp_regions_tests", [
        ("        def forward(ctx, y):\n            return reduce_scatter(y)\n\n        @staticmethod\n"
         "        def backward(ctx, grad):\n            return gather(grad)\n",
         "        def forward(ctx, y):\n            return reduce_scatter(y)\n\n        @staticmethod\n"
         "        def backward(ctx, grad):\n            return grad.repeat(1, dist.get_world_size(), 1)\n")]),
    "sp_all_reduce_then_keep_my_positions": ("sp_regions", "sp_regions_tests", [
        ("        full = y.movedim(1, 0).contiguous()\n"
         "        out = full.new_empty((full.shape[0] // dist.get_world_size(), *full.shape[1:]))\n"
         "        scatter_into(out, full)\n        return out.movedim(0, 1)\n",
         "        total = y.clone()\n        dist.all_reduce(total)\n"
         "        return total.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]\n")]),
    "merge_old_output_not_rescaled": ("cp1_merge", "cp1_merge_tests", [
        ("out = out_a * torch.exp(lse_a - finite)[..., None] + out_b * torch.exp(lse_b - finite)[..., None]",
         "out = out_a + out_b * torch.exp(lse_b - finite)[..., None]")]),
    "merge_weights_not_normalised": ("cp1_merge", "cp1_merge_tests", [
        ("out = out_a * torch.exp(lse_a - finite)[..., None] + out_b * torch.exp(lse_b - finite)[..., None]",
         "out = out_a * torch.exp(lse_a)[..., None] + out_b * torch.exp(lse_b)[..., None]")]),
    "merge_lse_is_the_max": ("cp1_merge", "cp1_merge_tests", [
        ("lse = torch.logaddexp(lse_a, lse_b)", "lse = torch.maximum(lse_a, lse_b)")]),
    "merge_exponentiates_the_lse": ("cp1_merge", "cp1_merge_tests", [
        ("    lse = torch.logaddexp(lse_a, lse_b)\n"
         "    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)\n"
         "    out = out_a * torch.exp(lse_a - finite)[..., None] + out_b * torch.exp(lse_b - finite)[..., None]\n",
         "    total = torch.exp(lse_a) + torch.exp(lse_b)\n"
         "    lse = torch.log(total)\n"
         "    out = (out_a * torch.exp(lse_a)[..., None] + out_b * torch.exp(lse_b)[..., None]) / total[..., None]\n")]),
    "merge_nan_where_no_key": ("cp1_merge", "cp1_merge_tests", [
        ("    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)\n", "    finite = lse\n")]),
    "ring_mask_by_local_rows": ("cp2_ring", "cp2_ring_tests", [
        ("allowed = q_pos[:, None] >= positions_of((rank - step) % size)[None, :]\n                if allowed.any():\n"
         "                    scores = (q.float() @ block_k.float().transpose(-2, -1)) * scale\n"
         "                    scores = scores.masked_fill",
         "allowed = torch.arange(q.shape[-2])[:, None] >= torch.arange(k.shape[-2])[None, :]\n"
         "                if allowed.any():\n"
         "                    scores = (q.float() @ block_k.float().transpose(-2, -1)) * scale\n"
         "                    scores = scores.masked_fill")]),
    "ring_one_block_short": ("cp2_ring", "cp2_ring_tests", [
        ("            block_k, block_v = k, v\n            for step in range(size):\n                if step < size - 1:\n",
         "            block_k, block_v = k, v\n            for step in range(size - 1):\n                if step < size - 1:\n")]),
    "ring_gradients_not_sent_home": ("cp2_ring", "cp2_ring_tests", [
        ("                if step < size - 1:  # the block moves on with its gradients\n"
         "                    block_k, block_v, dk, dv = arrived(*pass_on([block_k, block_v, dk, dv]))\n"
         "                else:  # one more pass: every block's gradients are home\n"
         "                    dk, dv = arrived(*pass_on([dk, dv]))\n",
         "                if step < size - 1:\n"
         "                    block_k, block_v = arrived(*pass_on([block_k, block_v]))\n")]),
    "ring_assumes_a_contiguous_split": ("cp2_ring", "cp2_ring_tests", [
        ("    def pass_on(tensors):", "    def positions_of(r):  # rank r holds rows r n .. r n + n - 1\n"
         "        return torch.arange(r * q.shape[-2], (r + 1) * q.shape[-2])\n\n    def pass_on(tensors):")]),
    "ring_masked_blocks_computed": ("cp2_ring", "cp2_ring_tests", [
        ("                allowed = q_pos[:, None] >= positions_of((rank - step) % size)[None, :]\n"
         "                if allowed.any():\n                    scores = (q.float() @ block_k.float().transpose(-2, -1)) * scale\n"
         "                    scores = scores.masked_fill",
         "                allowed = q_pos[:, None] >= positions_of((rank - step) % size)[None, :]\n"
         "                if True:\n                    scores = (q.float() @ block_k.float().transpose(-2, -1)) * scale\n"
         "                    scores = scores.masked_fill")]),
}, delegations={
    "sp_regions": """\
def sequence_parallel_regions():
    from course_lib.tensor_parallel import (gather_from_sequence_parallel_region,
                                            reduce_scatter_to_sequence_parallel_region)

    return gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
""",
    "cp1_merge": """\
def merge_attention(out_a, lse_a, out_b, lse_b):
    from course_lib.context_parallel import merge

    return merge(out_a, lse_a, out_b, lse_b)
""",
    "cp2_ring": """\
def ring_attention(q, k, v, positions_of, merge):
    from course_lib.context_parallel import ring_attention as library

    contiguous = bool((positions_of(1)[0] == q.shape[-2]).item())
    return library(q, k, v, layout="contiguous" if contiguous else "zigzag")
""",
}, alternatives={
    "sp_regions": """\
def sequence_parallel_regions():
    # list collectives, one piece per rank, concatenated and split along the sequence
    def pieces_of(tensor):
        return [part.contiguous() for part in tensor.chunk(dist.get_world_size(), dim=1)]

    def everyone(tensor):
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=1)

    def my_sum(tensor):
        mine = torch.empty_like(pieces_of(tensor)[dist.get_rank()])
        dist.reduce_scatter(mine, pieces_of(tensor))
        return mine

    class GatherSequence(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: everyone(x))
        backward = staticmethod(lambda ctx, grad: my_sum(grad))

    class ScatterSequence(torch.autograd.Function):
        forward = staticmethod(lambda ctx, y: my_sum(y))
        backward = staticmethod(lambda ctx, grad: everyone(grad))

    return GatherSequence.apply, ScatterSequence.apply
""",
    "cp1_merge": """\
def merge_attention(out_a, lse_a, out_b, lse_b):
    # the larger log-sum-exp factored out: weights exp(lse_x - top) <= 1, and 0 for a set with no key
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    lse = torch.where(total > 0, top + torch.log(total), torch.full_like(total, float("-inf")))
    share_a = torch.where(total > 0, weight_a / total, torch.zeros_like(total))
    share_b = torch.where(total > 0, weight_b / total, torch.zeros_like(total))
    return share_a.unsqueeze(-1) * out_a + share_b.unsqueeze(-1) * out_b, lse
""",
    "cp2_ring": """\
def ring_attention(q, k, v, positions_of, merge):
    me, world = dist.get_rank(), dist.get_world_size()
    right, left = (me + 1) % world, (me - 1) % world
    mine = positions_of(me)
    scale = q.shape[-1] ** -0.5

    def rotate(*tensors):
        incoming = [torch.zeros_like(t) for t in tensors]
        requests = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, left) for buf in incoming]
                                          + [dist.P2POp(dist.isend, t.contiguous(), right) for t in tensors])
        for request in requests:
            request.wait()
        return incoming

    def visible(step):
        owner = (me - step) % world
        return mine.unsqueeze(1) >= positions_of(owner).unsqueeze(0)

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            acc, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], -math.inf)
            kv = torch.stack([k, v])
            for step in range(world):
                mask = visible(step)
                if bool(mask.any()):
                    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), kv[0].float()) * scale
                    s = torch.where(mask, s, torch.tensor(-math.inf))
                    m = torch.logsumexp(s, -1)
                    p = torch.exp(s - torch.nan_to_num(m, neginf=0.0).unsqueeze(-1))
                    acc, lse = merge(acc, lse, torch.einsum("bhqk,bhkd->bhqd", p, kv[1].float()), m)
                if step + 1 < world:
                    (kv,) = rotate(kv)
            ctx.save_for_backward(q, k, v, acc, lse)
            return acc.to(q.dtype)

        @staticmethod
        def backward(ctx, grad):
            q, k, v, acc, lse = ctx.saved_tensors
            g = grad.float()
            d = (g * acc).sum(-1, keepdim=True)
            base = torch.nan_to_num(lse, neginf=0.0).unsqueeze(-1)
            grad_q = torch.zeros(q.shape)
            travelling = torch.stack([k.float(), v.float(), torch.zeros(k.shape), torch.zeros(v.shape)])
            for step in range(world):
                mask = visible(step)
                if bool(mask.any()):
                    kk, vv = travelling[0], travelling[1]
                    p = torch.exp(torch.einsum("bhqd,bhkd->bhqk", q.float(), kk) * scale - base) * mask
                    ds = p * (torch.einsum("bhqd,bhkd->bhqk", g, vv) - d)
                    grad_q += torch.einsum("bhqk,bhkd->bhqd", ds, kk) * scale
                    travelling[2] += torch.einsum("bhqk,bhqd->bhkd", ds, q.float()) * scale
                    travelling[3] += torch.einsum("bhqk,bhqd->bhkd", p, g)
                (travelling,) = rotate(travelling)
            return grad_q.to(q.dtype), travelling[2].to(k.dtype), travelling[3].to(v.dtype)

    return RingAttention.apply(q, k, v)
""",
})

EXPERT_PARALLEL_EXERCISES = GradedNotebook("session_f", "02b_expert_parallel_exercises", {
    "route_weights_not_renormalised": ("ep1_route", "ep1_route_tests", [
        ("    weights = top_probs / top_probs.sum(-1, keepdim=True)\n", "    weights = top_probs\n")]),
    "route_one_slot_too_many": ("ep1_route", "ep1_route_tests", [
        ("slots = torch.where(place < capacity, place,", "slots = torch.where(place <= capacity, place,")]),
    "route_least_probable_experts": ("ep1_route", "ep1_route_tests", [
        ("top_probs, experts = probs.topk(top_k, dim=-1)", "top_probs, experts = probs.topk(top_k, dim=-1, largest=False)")]),
    "route_queues_filled_token_by_token": ("ep1_route", "ep1_route_tests", [
        ("    order = experts.t().reshape(-1)  # every token's first choice, then every second choice, ...\n",
         "    order = experts.reshape(-1)  # token by token\n"),
        ("    return experts, weights, slots.view(top_k, -1).t(), probs", "    return experts, weights, slots.view(-1, top_k), probs")]),
    "moe_weights_not_applied": ("ep2_moe", "ep2_moe_tests", [
        ("index_add(0, token, back[row] * weights[token, choice, None])", "index_add(0, token, back[row])")]),
    "moe_buffer_rows_slot_major": ("ep2_moe", "ep2_moe_tests", [
        ("    row = experts_of[token, choice] * c + slots[token, choice]  # the row of the (E * C, d) buffer\n",
         "    row = slots[token, choice] * n_experts + experts_of[token, choice]\n")]),
    "moe_outputs_not_sent_back": ("ep2_moe", "ep2_moe_tests", [
        ("    back = AllToAll.apply(done.reshape(-1, d))  # my tokens' outputs, in the buffer's layout\n",
         "    back = done.reshape(-1, d)\n")]),
    "moe_aux_from_kept_assignments": ("ep2_moe", "ep2_moe_tests", [
        ("    f = F.one_hot(experts_of.reshape(-1), n_experts).float().mean(0)\n",
         "    f = F.one_hot(experts_of[token, choice], n_experts).float().sum(0) / experts_of.numel()\n")]),
    "moe_capacity_rounded_down": ("ep2_moe", "ep2_moe_tests", [
        ("    c = math.ceil(capacity_factor * tokens * top_k / n_experts)\n",
         "    c = int(capacity_factor * tokens * top_k / n_experts)\n")]),
    "moe_one_expert_per_rank": ("ep2_moe", "ep2_moe_tests", [
        ("    received = AllToAll.apply(dispatch).view(size, local, c, d)  # from each rank, the rows of my experts\n"
         "    done = torch.stack([expert(received[:, j]) for j, expert in enumerate(experts)], dim=1)\n",
         "    received = AllToAll.apply(dispatch).view(size, -1, d)  # from each rank, my expert's rows\n"
         "    done = experts[0](received)\n")]),
}, delegations={
    "ep1_route": """\
def route(logits, top_k, capacity):
    from course_lib.expert_parallel import route as library_route

    return library_route(logits, top_k, capacity)
""",
    "ep2_moe": """\
def expert_parallel_moe(x, router, experts, n_experts, top_k, capacity_factor, route):
    from course_lib.expert_parallel import MoE, ExpertParallelMoE

    moe = MoE(x.shape[1], experts[0].up.out_features, n_experts, top_k, capacity_factor)
    layer = ExpertParallelMoE(moe)
    layer.router, layer.experts = router, experts
    return layer(x)
""",
}, alternatives={
    "ep1_route": """\
def route(logits, top_k, capacity):
    probs = logits.float().softmax(-1)
    best = logits.float().topk(top_k, dim=-1)
    experts = best.indices
    weights = best.values.softmax(-1)  # Mixtral's way: the softmax of the chosen logits is the renormalised probability
    slots = torch.full(experts.shape, -1, dtype=torch.long)
    taken = [0] * logits.shape[-1]
    for choice in range(top_k):
        for token in range(logits.shape[0]):
            expert = int(experts[token, choice])
            if taken[expert] < capacity:
                slots[token, choice] = taken[expert]
                taken[expert] += 1
    return experts, weights, slots, probs
""",
    "ep2_moe": """\
def expert_parallel_moe(x, router, experts, n_experts, top_k, capacity_factor, route):
    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, buffer):
            result = buffer.new_empty(buffer.shape)
            dist.all_to_all_single(result, buffer.contiguous())
            return result

        @staticmethod
        def backward(ctx, grad):
            result = grad.new_empty(grad.shape)
            dist.all_to_all_single(result, grad.contiguous())
            return result

    ranks, per_rank = dist.get_world_size(), n_experts // dist.get_world_size()
    n_tokens, width = x.shape
    cap = math.ceil(capacity_factor * n_tokens * top_k / n_experts)
    chosen, weight, slot, probs = route(router(x), top_k, cap)
    placed = torch.zeros(n_tokens, n_experts, cap)  # GShard's dispatch mask: token t in slot c of expert e
    for t in range(n_tokens):
        for j in range(top_k):
            if slot[t, j] >= 0:
                placed[t, chosen[t, j], slot[t, j]] = 1.0
    buffer = torch.einsum("tec,td->ecd", placed, x)
    arrived = Exchange.apply(buffer.reshape(n_experts * cap, width)).reshape(ranks, per_rank, cap, width)
    results = torch.stack([experts[j](arrived[:, j].reshape(-1, width)).reshape(ranks, cap, width)
                           for j in range(per_rank)], dim=1)
    home = Exchange.apply(results.reshape(n_experts * cap, width)).reshape(n_experts, cap, width)
    gate = placed * torch.zeros(n_tokens, n_experts).scatter(1, chosen, weight)[:, :, None]  # the combine weights
    out = torch.einsum("tec,ecd->td", gate, home)
    counts = torch.bincount(chosen.flatten(), minlength=n_experts).float() / chosen.numel()
    return out, n_experts * torch.dot(counts, probs.mean(0))
""",
})

GRADED = [MODEL_FROM_SCRATCH, DDP_EXERCISES, TRAINER_EXERCISES, CLUSTER_EXERCISES, JOB_EXERCISES, DEBUGGING_LAB, DEBUGGING_LAB_SILENT, ZERO_EXERCISES, SHARDING_EXERCISES, MODEL_PARALLEL_EXERCISES, MESH_LAYOUT, LORA_FINETUNING,
          LONG_CONTEXT_EXERCISES, EXPERT_PARALLEL_EXERCISES]
NBGRADED = [MODEL_FROM_SCRATCH, ZERO_EXERCISES, MESH_LAYOUT, LONG_CONTEXT_EXERCISES]
"""Notebooks that nbgrader itself autogrades (solutions and a mixed submission): one per kind of exercise (a
function, a training algorithm on ranks, a layout, a collective written by hand), their mixed submissions together
carrying every kind of mutant. The others' solutions and untouched releases are graded by the sandbox, the very
step nbgrader's autograde runs (nbgrader_config.py): the same verdicts without nbgrader's start-up per notebook."""


def grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def points(path: Path) -> dict[str, float]:
    """{test cell id: points} of a notebook's autograded cells."""
    nb = nbformat.read(path, as_version=4)
    return {grade_id(c): float(c.metadata.nbgrader["points"]) for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}


def solution_code(notebook: GradedNotebook) -> dict[str, str]:
    """{solution cell id: its code as a learner would write it (no markers)}."""
    return {grade_id(c): without_markers(c.source) for c in nbformat.read(notebook.source, as_version=4).cells
            if c.metadata.get("nbgrader", {}).get("solution")}


def untouched_code(notebook: GradedNotebook) -> dict[str, str]:
    """{solution cell id: its code in the released student version (the stub)}."""
    return {grade_id(c): c.source for c in nbformat.read(notebook.student_version, as_version=4).cells
            if c.metadata.get("nbgrader", {}).get("solution")}


def graded_by(notebook: GradedNotebook) -> dict[str, str]:
    """{solution cell id: the test cell that grades it}."""
    return {answer: exercise.test_id for exercise in read_exercises(notebook.source).exercises
            for answer in exercise.answer_ids}


def with_wrong_answer(notebook: GradedNotebook, name: str) -> str:
    solution_cell, _, edits = notebook.wrong_answers[name]
    code = solution_code(notebook)[solution_cell]
    for right, wrong in edits:
        assert code.count(right) == 1, (f"{notebook}: the solution of {solution_cell} no longer contains {right!r} "
                                        "exactly once: update its wrong answers")
        code = code.replace(right, wrong)
    return code


def top_level_functions(code: str) -> list[str]:
    return [node.name for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)]


def setup_modules(notebook: GradedNotebook) -> dict[str, object]:
    """{name: module} of the modules the notebook's setup cell imports (`import torch`, `... import model as library`)."""
    setup = next(c.source for c in nbformat.read(notebook.source, as_version=4).cells if grade_id(c) == "setup")
    found = {}
    for node in ast.parse(setup).body:
        for alias in getattr(node, "names", []) if isinstance(node, (ast.Import, ast.ImportFrom)) else []:
            module = alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
            try:
                found[alias.asname or alias.name.split(".")[0]] = importlib.import_module(
                    module if alias.asname or isinstance(node, ast.ImportFrom) else alias.name.split(".")[0])
            except ImportError:
                continue  # a name, not a module
    return found


def changing_the_checks(notebook: GradedNotebook, code: str) -> str:
    """The answer followed by lines that disarm the checks: assert_close, isclose, the library's reference."""
    modules = setup_modules(notebook)
    lines = [line for name, line in CHECKS_CHEAT.items() if name in modules]
    defined = [n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    lines += [f"{alias}.{name} = {name}" for alias, module in modules.items()
              if module.__name__.startswith("course_lib") for name in defined if hasattr(module, name)]
    assert lines, f"{notebook}: no check to disarm in its setup"
    return code + "\n\n" + "\n".join(lines) + "\n"


def lying(code: str) -> str:
    """The answer's first function made to return an object equal to anything (a class answer gets the class)."""
    functions = top_level_functions(code)
    if not functions:
        return code + LYING_CLASSES
    name = functions[0]
    renamed = re.sub(rf"^def {name}\(", f"def _wrong_{name}(", code, count=1, flags=re.MULTILINE)
    return (renamed + LYING_CLASSES + f"""

def {name}(*args, **kwargs):
    result = _wrong_{name}(*args, **kwargs)
    return AlwaysEqual(result) if isinstance(result, (list, tuple, range)) else result
""")


def mutants(notebook: GradedNotebook) -> dict[str, tuple[str, str, str]]:
    """{mutant name: (kind, solution cell, answer code)} for every wrong answer and every cheat."""
    found = {name: ("wrong answer", cell, with_wrong_answer(notebook, name))
             for name, (cell, _, _) in notebook.wrong_answers.items()}
    first_wrong = {}
    for name, (cell, _, _) in notebook.wrong_answers.items():
        first_wrong.setdefault(cell, found[name][2])
    for cell, wrong in first_wrong.items():
        found[f"{cell}:changing the checks"] = ("changing the checks", cell, changing_the_checks(notebook, wrong))
        found[f"{cell}:changing the kernel"] = ("changing the kernel", cell, wrong + KERNEL_CHEAT)
        found[f"{cell}:lying objects"] = ("lying objects", cell, lying(wrong))
        found[f"{cell}:patching through an alias"] = ("patching through an alias", cell, wrong + ALIAS_CHEAT)
        found[f"{cell}:code loaded at run time"] = ("code loaded at run time", cell, wrong + RUNTIME_CHEAT)
    for cell, code in notebook.delegations.items():
        found[f"{cell}:delegation"] = ("delegation", cell, code)
    for cell, codes in notebook.more_delegations.items():
        for i, code in enumerate(codes, start=2):
            found[f"{cell}:delegation {i}"] = ("delegation", cell, code)
    return found


def alternative_submissions(notebook: GradedNotebook) -> dict[str, dict[str, str]]:
    """{submission name: {cell: right answer written differently}}: "alternatives" holds one per exercise, the
    others one idiom each."""
    found = {"alternatives": dict(notebook.alternatives)}
    for cell, codes in notebook.more_alternatives.items():
        for i, code in enumerate(codes, start=2):
            found[f"alternative {i} of {cell}"] = {cell: code}
    return found


MUTANTS = [(notebook, name) for notebook in GRADED for name in mutants(notebook)]


@dataclass
class Checked:
    """One graded notebook's results from the grading sandbox: mutant (or "alternatives") -> test cell -> result."""

    results: dict


@pytest.fixture(scope="module")
def checked() -> dict[str, Checked]:
    """Every mutant graded against its own exercise, and the right answers written differently against theirs."""
    def run(notebook):
        solutions = solution_code(notebook)
        tests = graded_by(notebook)
        submissions, only = {}, {}
        for name, (_, cell, code) in mutants(notebook).items():
            submissions[name], only[name] = {**solutions, cell: code}, [tests[cell]]
        for name, answers in alternative_submissions(notebook).items():
            submissions[name] = {**solutions, **answers}
            only[name] = [tests[cell] for cell in answers]
        every_test = sorted(set(tests.values()))
        if notebook not in NBGRADED:  # nbgrader grades these two itself for the notebooks of NBGRADED
            submissions["solutions"], only["solutions"] = solutions, every_test
        if notebook is not MESH_LAYOUT:
            submissions["untouched"], only["untouched"] = untouched_code(notebook), every_test
        return Checked(grade(notebook.source, submissions, only=only))

    with ThreadPoolExecutor(SCRATCH_COURSES) as pool:
        return dict(zip(map(str, GRADED), pool.map(run, GRADED)))


def mixed_submission(notebook: GradedNotebook, offset: int):
    """The student version answered right, except exercise i, which gets mutant kind (i + offset) of
    [first wrong answer, changing the checks, changing the kernel, lying objects, delegation]; the last
    exercise of a notebook with several stays right. A kernel-changing cell is added after the setup."""
    found = mutants(notebook)
    exercises = read_exercises(notebook.source).exercises
    kinds = ["wrong answer", "changing the checks", "changing the kernel", "lying objects", "delegation",
             "patching through an alias", "code loaded at run time"]
    answers, mutated = dict(solution_code(notebook)), {}
    for i, exercise in enumerate(exercises[:-1] if len(exercises) > 1 else exercises):
        cell = exercise.answer_ids[0]
        kind = kinds[(i + offset) % len(kinds)]
        options = [code for k, c, code in found.values() if k == kind and c == cell]
        if options:
            answers[cell], mutated[exercise.test_id] = options[0], kind
    nb = nbformat.read(notebook.student_version, as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = answers[grade_id(cell)]
    setup = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "setup")
    nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(KERNEL_CHEAT.strip() + "\n" + "\n".join(CHECKS_CHEAT.values())))
    return nb, mutated


@dataclass
class Grades:
    """One graded notebook's nbgrader results: student -> test cell id -> (score, max_score) / printed text."""

    scores: dict[str, dict[str, tuple[float, float]]]
    printed: dict[str, dict[str, str]]
    mutated: dict[str, dict[str, str]]  # student -> test cell id -> mutant kind
    courses: dict[str, Path] = field(default_factory=dict)  # student -> the scratch course that graded it


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, Grades]:
    """nbgrader autogrades, for every notebook of NBGRADED, its solutions and a mixed submission (mutant kinds
    rotated so that together they use every kind), and the untouched release of MESH_LAYOUT (whose feedback page
    is checked), spread over SCRATCH_COURSES scratch courses graded side by side."""
    jobs, mutated, offset = [], {}, 0
    for notebook in NBGRADED:
        submissions = {"solutions": nbformat.read(notebook.source, as_version=4)}
        if notebook is MESH_LAYOUT:
            submissions["untouched"] = nbformat.read(notebook.student_version, as_version=4)
        submissions["mixed"], mutated[str(notebook), "mixed"] = mixed_submission(notebook, offset)
        offset += len(mutated[str(notebook), "mixed"])
        jobs += [(notebook, student, nb) for student, nb in submissions.items()]
    assignment_ids = sorted({notebook.assignment for notebook in NBGRADED})
    courses = [grading.stage_course(REPO_ROOT, tmp_path_factory.mktemp("course"), assignment_ids)
               for _ in range(SCRATCH_COURSES)]
    course_of = {}
    for i, (notebook, student, nb) in enumerate(jobs):  # alternate, so each course gets half of every notebook
        course_of[notebook, student] = courses[i % len(courses)]
        path = courses[i % len(courses)] / "submitted" / student / notebook.assignment / f"{notebook.name}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)  # an assignment may hold several graded notebooks
        nbformat.write(nb, path)
    with ThreadPoolExecutor(len(courses)) as pool:
        by_course = dict(zip(courses, pool.map(grading.autograde, courses)))
    results = {str(notebook): Grades({}, {}, {}) for notebook in NBGRADED}
    for (notebook, student), course in course_of.items():
        grades = results[str(notebook)]
        grades.scores[student] = by_course[course][student][notebook.assignment][notebook.name]
        grades.mutated[student] = mutated.get((str(notebook), student), {})
        grades.courses[student] = course
        nb = nbformat.read(course / "autograded" / student / notebook.assignment / f"{notebook.name}.ipynb", as_version=4)
        grades.printed[student] = {grade_id(c): "".join(o.get("text", "") for o in c.outputs)
                                   for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    return results


def test_every_graded_notebook_declares_its_mutants():
    with_graded_cells = {path for path in SOURCES if points(path)}
    assert with_graded_cells == {notebook.source for notebook in GRADED}, (
        "every notebook with autograded cells needs a GradedNotebook entry (with its mutants) in GRADED: "
        f"{sorted(str(p.relative_to(REPO_ROOT)) for p in with_graded_cells ^ {n.source for n in GRADED})}")


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_every_exercise_has_its_wrong_answers_cheats_and_a_right_answer_written_differently(notebook):
    cells = graded_by(notebook)
    for name, (solution_cell, test_cell, edits) in notebook.wrong_answers.items():
        assert solution_cell in cells, f"{notebook}, {name}: {solution_cell} is not a solution cell of an exercise"
        assert cells[solution_cell] == test_cell, f"{notebook}, {name}: {solution_cell} is graded by {cells[solution_cell]}"
        assert edits and all(right != wrong for right, wrong in edits), f"{notebook}, {name}: no edit"
    found = mutants(notebook)
    for cell in cells:
        wrong = [name for name, (c, _, _) in notebook.wrong_answers.items() if c == cell]
        assert len(wrong) >= MIN_WRONG_ANSWERS, f"{notebook}, {cell}: {len(wrong)} wrong answers, want {MIN_WRONG_ANSWERS}"
        kinds = {kind for kind, c, _ in found.values() if c == cell}
        assert set(CHEAT_KINDS) <= kinds, f"{notebook}, {cell}: no cheat of kind {sorted(set(CHEAT_KINDS) - kinds)}"
        assert cell in notebook.alternatives, f"{notebook}, {cell}: no right answer written differently"
        assert notebook.alternatives[cell].strip() != solution_code(notebook)[cell].strip()


@pytest.mark.parametrize(("notebook", "name"), MUTANTS, ids=[f"{notebook.name}:{name}" for notebook, name in MUTANTS])
def test_mutant_loses_its_points(checked, notebook, name):
    kind, cell, _ = mutants(notebook)[name]
    test_cell = graded_by(notebook)[cell]
    result = checked[str(notebook)].results[name][test_cell]
    assert not result.passed, f"{name} ({kind}) passed {test_cell}; it printed:\n{result.output}"
    refused = result.error.startswith("AnswerRefused")
    if kind == "wrong answer":
        assert not refused, f"{name}: a wrong answer must be caught by the tests, not refused:\n{result.error}"
    elif kind == "code loaded at run time":
        assert "IntegrityError: `torch.testing.assert_close` is what the checks judge with" in result.error, (
            f"{name}: the integrity snapshot should name the replaced function:\n{result.error[-2000:]}")
    else:
        assert refused, f"{name} ({kind}) should be refused before it runs; it failed with:\n{result.error[-2000:]}"


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_right_answers_written_differently_score_full_marks(checked, notebook):
    failed = {f"{name}: {test}": r.error[-1500:] for name in alternative_submissions(notebook)
              for test, r in checked[str(notebook)].results[name].items() if not r.passed}
    assert not failed, f"{notebook}: right answers written differently lost points: {failed}"


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_hidden_tests_of_every_exercise_catch_a_wrong_answer_the_visible_tests_miss(checked, notebook):
    """For each exercise, some wrong answer passes the visible tests and is caught only by the hidden ones."""
    results = checked[str(notebook)].results
    caught_by_hidden = set()
    for name, (cell, test_cell, _) in notebook.wrong_answers.items():
        printed = results[name][test_cell].output
        if "visible tests passed" in printed and "hidden tests passed" not in printed:
            caught_by_hidden.add(test_cell)
    missing = sorted(set(points(notebook.source)) - caught_by_hidden)
    assert not missing, f"{notebook}: no wrong answer is caught by the hidden tests alone for: {missing}"


# ------------------------------------------------------------------ release

@pytest.fixture(scope="module")
def fresh_release(tmp_path_factory):
    """A release of the repository's solutions/ built in a scratch folder."""
    fresh = tmp_path_factory.mktemp("fresh-release")
    grading.build_release(REPO_ROOT, fresh)
    return fresh


def test_release_is_not_stale(fresh_release):
    stale = grading.compare_release(fresh_release, REPO_ROOT)
    assert not stale, f"notebooks/ is stale, run `python scripts/grading.py release` and commit: {stale}"


def test_stale_and_orphan_notebooks_are_reported(fresh_release, tmp_path):
    assignment, name = MODEL_FROM_SCRATCH.assignment, MODEL_FROM_SCRATCH.name
    shutil.copytree(REPO_ROOT / "solutions", tmp_path / "solutions")
    shutil.copytree(fresh_release, tmp_path / "notebooks")
    assert grading.compare_release(fresh_release, tmp_path) == []
    edited = tmp_path / "notebooks" / assignment / f"{name}.ipynb"
    edited.write_text(edited.read_text().replace("raise NotImplementedError(", "print(", 1))
    shutil.copyfile(edited, tmp_path / "notebooks" / assignment / "99_no_source.ipynb")
    assert grading.compare_release(fresh_release, tmp_path) == [
        f"notebooks/{assignment}/{name}.ipynb", f"notebooks/{assignment}/99_no_source.ipynb"]


def test_release_twice_gives_identical_files(fresh_release, tmp_path):
    assert {p.relative_to(fresh_release) for p in fresh_release.rglob("*.ipynb")} == \
        {s.relative_to(REPO_ROOT / "solutions") for s in SOURCES}
    shutil.copytree(fresh_release, tmp_path, dirs_exist_ok=True)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert grading.release(REPO_ROOT, tmp_path) == [], "releasing again changed files"
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    record = after.pop(tmp_path / grading.RELEASED)  # what release wrote, for the next release to compare with
    assert after == before
    assert grading.edited_since_release(tmp_path, sorted(tmp_path.rglob("*.ipynb"))) == [], record[:200]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_release_contains_no_solution_and_no_hidden_test(source):
    released = REPO_ROOT / "notebooks" / source.relative_to(REPO_ROOT / "solutions")
    assert released.is_file(), f"{released} is missing: run `python scripts/grading.py release`"
    source_cells = nbformat.read(source, as_version=4).cells
    release_cells = nbformat.read(released, as_version=4).cells
    release_lines = {line.strip() for cell in release_cells for line in cell.source.splitlines()}
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert not any(marker in cell.source for cell in release_cells), f"{released}: contains '### {marker}'"
    # Lines that exist only inside solution / hidden-test regions must not reach the release.
    secret, public = set(), set()
    for cell in source_cells:
        inside = False
        for line in cell.source.splitlines():
            if line.strip().startswith(("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS")):
                inside = True
            elif line.strip().startswith(("### END SOLUTION", "### END HIDDEN TESTS")):
                inside = False
            else:
                (secret if inside else public).add(line.strip())
    leaked = sorted(line for line in (secret - public) & release_lines if line and not line.startswith("#"))
    assert not leaked, f"{released}: solution or hidden-test lines leaked: {leaked}"
    for cell in release_cells:
        if cell.metadata.get("nbgrader", {}).get("solution") and cell.cell_type == "code":
            assert "raise NotImplementedError(\"" in cell.source, f"{released}, {grade_id(cell)}: no code stub"
            assert ": replace this line with your code" in cell.source, f"{released}, {grade_id(cell)}: the stub says what to do"


# ------------------------------------------------------------------ autograde, through nbgrader

@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_solutions_score_full_marks(checked, graded, notebook):
    expected = points(notebook.source)
    if notebook not in NBGRADED:  # graded by the sandbox, the step nbgrader's autograde runs
        results = checked[str(notebook)].results["solutions"]
        assert set(results) == set(expected), f"graded cells {sorted(results)} != test cells {sorted(expected)}"
        lost = {cell: r.error[-1500:] for cell, r in results.items() if not r.passed}
        assert not lost, f"{notebook}: the solutions lose points: {lost}"
        return
    grades = graded[str(notebook)]
    got = grades.scores["solutions"]
    assert set(got) == set(expected), f"graded cells {sorted(got)} != test cells of the notebook {sorted(expected)}"
    lost = {cell: score for cell, score in got.items() if score != (expected[cell], expected[cell])}
    assert not lost, f"{notebook}: the solutions lose points: {lost}\n{ {c: grades.printed['solutions'][c] for c in lost} }"


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_untouched_release_scores_zero_on_every_graded_cell(checked, graded, notebook):
    if notebook is not MESH_LAYOUT:  # graded by the sandbox: the student version's answer cells, as released
        results = checked[str(notebook)].results["untouched"]
        assert set(results) == set(points(notebook.source))
        passed = sorted(cell for cell, r in results.items() if r.passed)
        assert not passed, f"{notebook}: the untouched release passes {passed}"
        return
    got = graded[str(notebook)].scores["untouched"]
    assert set(got) == set(points(notebook.source))
    assert all(max_score > 0 for _, max_score in got.values())
    assert {cell: score for cell, (score, _) in got.items() if score != 0} == {}


def test_the_macos_start_path_grades_a_multi_rank_exercise():
    """On macOS nothing that has imported torch forks: each check is a fresh interpreter that runs the setup cells,
    and its ranks are spawned (course_tools.grading.sandbox.start_method). Forced here on Linux: the solution of a
    check whose worker patches a collective on every rank passes, and a wrong answer fails, as on the fork path."""
    test_id, cell = "ddp1_overlap_tests", "ddp1_overlap"
    wrong = next(code for kind, c, code in mutants(DDP_EXERCISES).values() if kind == "wrong answer" and c == cell)
    solutions = solution_code(DDP_EXERCISES)
    results = grade(DDP_EXERCISES.source, {"solutions": solutions, "wrong": {**solutions, cell: wrong}},
                    only=[test_id], method="spawn")
    assert results["solutions"][test_id].passed, results["solutions"][test_id].error[-2000:]
    assert not results["wrong"][test_id].passed and results["wrong"][test_id].error


@pytest.mark.parametrize("notebook", NBGRADED, ids=str)
def test_mixed_submission_loses_exactly_the_mutated_exercises(graded, notebook):
    grades, expected, student = graded[str(notebook)], points(notebook.source), "mixed"
    mutated = grades.mutated[student]
    assert mutated, f"{notebook}: the mixed submission mutates no exercise"
    got = grades.scores[student]
    wrong = {cell: got[cell] for cell in expected
             if got[cell] != ((0.0 if cell in mutated else expected[cell]), expected[cell])}
    assert not wrong, (f"{notebook}, {student} (mutated: {mutated}): unexpected scores {wrong}\n"
                       f"{ {c: grades.printed[student][c][-1500:] for c in wrong} }")


def test_every_kind_of_mutant_goes_through_nbgrader(graded):
    kinds = {kind for notebook in NBGRADED for kind in graded[str(notebook)].mutated["mixed"].values()}
    assert kinds == {"wrong answer", *CHEAT_KINDS}, kinds


def test_score_table(graded):
    by_assignment = {}
    for notebook in NBGRADED:  # an assignment may hold several graded notebooks
        by_assignment.setdefault(notebook.assignment, {})[notebook.name] = graded[str(notebook)].scores["solutions"]
    scores = {"solutions": by_assignment}
    table = grading.format_scores(scores)
    rows = [line.split() for line in table.splitlines()]
    for notebook in NBGRADED:
        total = f"{sum(points(notebook.source).values()):g}"
        assert ["solutions", notebook.assignment, notebook.name, "TOTAL", total, "/", total] in rows, table
        assert {row[3] for row in rows[1:] if row[2] == notebook.name} == set(points(notebook.source)) | {"TOTAL"}, table


def test_the_course_grades_at_least_100_points_on_real_ranks_and_the_book_says_how_many():
    """Every graded notebook is in the mutant suite; the points add up to 100 or more; every session from B on has a
    graded notebook whose tests start ranks (four at least); Session A's chapter states the total."""
    sources = sorted(p for p in (REPO_ROOT / "solutions").glob("*/*.ipynb") if points(p))
    assert sources == sorted(notebook.source for notebook in GRADED), "a graded notebook is missing from GRADED"
    total = sum(sum(points(p).values()) for p in sources)
    assert total >= 100, f"the course grades {total:g} points, fewer than 100"
    launching = [p for p in sources if any(
        "run_on_ranks(" in c.source or "launch(" in c.source for c in nbformat.read(p, as_version=4).cells
        if c.metadata.get("nbgrader", {}).get("grade"))]
    assert len(launching) >= 4, f"only {len(launching)} graded notebooks start ranks in their tests: {launching}"
    assert {p.parent.name for p in launching} >= {"session_b", "session_c", "session_d", "session_e"}, launching
    chapter = (REPO_ROOT / "book" / "session_a" / "index.md").read_text(encoding="utf-8")
    assert f"{total:g} points in all" in chapter, f"book/session_a/index.md should say '{total:g} points in all'"


def test_feedback_renders_offline_and_keeps_the_hidden_tests_hidden(graded):
    """nbgrader's feedback page for a submission (the untouched release, autograded above): formulas from the
    vendored MathJax (no CDN), hidden tests absent, the failing check's message present."""
    notebook = MESH_LAYOUT
    course = graded[str(notebook)].courses["untouched"]
    grading.run_nbgrader(course, "generate_feedback", notebook.assignment, "--force", "--student=untouched")
    grading.offline_feedback(course / "feedback")
    page = course / "feedback" / "untouched" / notebook.assignment / f"{notebook.name}.html"
    html = page.read_text(encoding="utf-8")
    assert "cdnjs" not in html and "mathjax/2." not in html.lower(), "the feedback page loads MathJax from a CDN"
    local = re.search(r'<script src="([^"]*tex-chtml\.js)"', html)
    assert local and (page.parent / local.group(1)).resolve().is_file(), "the vendored MathJax is not where the page looks"
    cells = nbformat.read(notebook.source, as_version=4).cells
    split = [_regions(cell.source, ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")) for cell in cells]
    visible = "\n".join(rest for _, rest in split)
    hidden = [line.strip() for lines, _ in split for line in lines if len(line.strip()) > 30
              and line.strip() not in visible]
    assert hidden, "no hidden test lines to look for"
    shown = html_text(html)
    assert not [line for line in hidden if line in shown], "the feedback page shows hidden tests"
    assert "NotImplementedError" in shown, "the page should show why the untouched exercise failed"


def _regions(source: str, markers: tuple[str, str]) -> tuple[list[str], str]:
    """(lines between the markers, the rest)."""
    inside, lines, rest = False, [], []
    for line in source.splitlines():
        if line.strip().startswith(markers[0]):
            inside = True
        elif line.strip().startswith(markers[1]):
            inside = False
        else:
            (lines if inside else rest).append(line)
    return lines, "\n".join(rest)


def html_text(html: str) -> str:
    """The page's text with tags dropped and entities decoded (code is highlighted span by span)."""
    import html as html_module

    return html_module.unescape(re.sub(r"<[^>]+>", "", html))

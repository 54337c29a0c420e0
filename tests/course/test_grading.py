"""The grading pipeline: notebooks/ is a fresh, byte-stable release of solutions/ without solutions or
hidden tests, and autograding every graded notebook gives full marks to its solutions, 0 to its untouched
release, and takes away exactly the points of an exercise answered wrongly.

    .venv/bin/python -m pytest -q tests/course/test_grading.py

Each graded notebook is a GradedNotebook below with its table of plausible wrong answers; a notebook
with autograded cells but no entry fails test_every_graded_notebook_declares_its_wrong_answers.

Slow: nbgrader executes each graded notebook once per submission: the solutions, the untouched
release, each exercise's first wrong answer alone, and the other wrong answers combined (at most one
per exercise in a submission): 2 + (exercises) + (most wrong answers left in one exercise) executions,
today 11 for session_a, 10 for session_b (whose tests start ranks), 7 for session_c, 10 for session_d
(ranks again), 6 each for session_e's two notebooks. All of it is spread over two scratch courses graded
side by side. Grading happens in scratch course directories, so the
tests never write gradebook.db, submitted/ or autograded/ into the repository.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grading  # scripts/ is on sys.path (tests/conftest.py)
import nbformat
import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO_ROOT / "solutions").glob("*/*.ipynb"))
SCRATCH_COURSES = 2  # graded side by side, one kernel at a time in each

WrongAnswers = dict[str, tuple[str, str, list[tuple[str, str]]]]
"""name -> (solution cell, test cell that must lose its points, [(text of the solution, wrong text), ...])."""


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (the table is a dict)
class GradedNotebook:
    """A notebook with autograded cells, and plausible wrong answers, each written into one exercise of an
    otherwise correct submission.

    The first wrong answer of each exercise is graded alone, which shows it costs that exercise's points
    and nothing else; the others are graded together, at most one per exercise in a submission (the test
    cells are independent: each calls only its own exercise's code), which keeps the number of notebook
    executions small.
    """

    assignment: str
    name: str
    wrong_answers: WrongAnswers

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
        ("    indices += indices[:per_rank * world_size - num_samples]  # pad by repeating the start\n", "")]),
    "shard_epoch_ignored": ("dp2_shard_indices", "dp2_shard_indices_tests", [
        ("manual_seed(seed + epoch)", "manual_seed(seed)")]),
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
})

# Exercises 12-15 (session D). The tests of 14 and 15 start 2 ranks each (two launches per execution).
SHARDING_EXERCISES = GradedNotebook("session_d", "04_sharding_exercises", {
    "hybrid_mesh_transposed": ("ex12_settings", "ex12_settings_tests", [
        ("mesh_shape = (world_size // ranks_per_node, ranks_per_node)",
         "mesh_shape = (ranks_per_node, world_size // ranks_per_node)")]),
    "shard_grad_op_reshards_after_forward": ("ex12_settings", "ex12_settings_tests", [
        ('"SHARD_GRAD_OP": (2, False),', '"SHARD_GRAD_OP": (2, True),')]),
    "shard_grad_op_as_zero1": ("ex12_settings", "ex12_settings_tests", [
        ('"SHARD_GRAD_OP": (2, False),', '"SHARD_GRAD_OP": (1, False),')]),
    "no_shard_mesh_transposed": ("ex12_settings", "ex12_settings_tests", [
        ("mesh_shape = (world_size, 1)", "mesh_shape = (1, world_size)")]),
    "unknown_strategy_not_checked": ("ex12_settings", "ex12_settings_tests", [
        ("    if strategy not in table:\n"
         '        raise ValueError(f"unknown sharding strategy {strategy!r}; choose one of {list(table)}")\n', "")]),
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
})

# One pure-Python exercise; the lesson's later cells use course_lib.hybrid.layout, so only its points are at stake.
MESH_LAYOUT = GradedNotebook("session_e", "03_3d_parallelism", {
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
})

# Exercise 17's tests use the library's LoRALinear, so exercise 16's mistakes cost only exercise 16.
LORA_FINETUNING = GradedNotebook("session_e", "04_lora_finetuning", {
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
})

GRADED = [MODEL_FROM_SCRATCH, TRAINER_EXERCISES, CLUSTER_EXERCISES, SHARDING_EXERCISES, MESH_LAYOUT, LORA_FINETUNING]
WRONG = [(notebook, name) for notebook in GRADED for name in notebook.wrong_answers]


def grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def points(path: Path) -> dict[str, float]:
    """{test cell id: points} of a notebook's autograded cells."""
    nb = nbformat.read(path, as_version=4)
    return {grade_id(c): float(c.metadata.nbgrader["points"]) for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}


def without_markers(source: str) -> str:
    """A solution cell as a learner would write it: the solution code without nbgrader's marker lines."""
    return "\n".join(line for line in source.splitlines()
                     if not line.strip().startswith(("### BEGIN SOLUTION", "### END SOLUTION")))


def submissions_of_wrong_answers(wrong_answers: WrongAnswers) -> dict[str, list[str]]:
    """{student: wrong answers in that submission}: first of each exercise alone, then the rest combined."""
    by_exercise: dict[str, list[str]] = {}
    for name, (solution_cell, _, _) in wrong_answers.items():
        by_exercise.setdefault(solution_cell, []).append(name)
    students = {f"wrong-{names[0]}": [names[0]] for names in by_exercise.values()}
    for rank in range(1, max(len(names) for names in by_exercise.values())):
        students[f"wrong-combined-{rank}"] = [names[rank] for names in by_exercise.values() if len(names) > rank]
    return students


WRONG_SUBMISSIONS = {str(notebook): submissions_of_wrong_answers(notebook.wrong_answers) for notebook in GRADED}


def answered(notebook: GradedNotebook, wrong_answers: list[str]):
    """The student version with every exercise answered by the solution, except the named wrong answers."""
    solutions = {grade_id(c): c.source for c in nbformat.read(notebook.source, as_version=4).cells if grade_id(c)}
    edits = {notebook.wrong_answers[name][0]: notebook.wrong_answers[name][2] for name in wrong_answers}
    assert len(edits) == len(wrong_answers), f"two wrong answers for one exercise in {wrong_answers}"
    nb = nbformat.read(notebook.student_version, as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            code = without_markers(solutions[grade_id(cell)])
            for right, wrong in edits.get(grade_id(cell), []):
                assert code.count(right) == 1, (f"{notebook}: the solution of {grade_id(cell)} no longer contains "
                                                f"{right!r} exactly once: update its wrong answers")
                code = code.replace(right, wrong)
            cell.source = code
    return nb


@dataclass
class Grades:
    """One graded notebook's results: student -> test cell id -> (score, max_score) / text the cell printed."""

    scores: dict[str, dict[str, tuple[float, float]]]
    printed: dict[str, dict[str, str]]


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, Grades]:
    """Autograde, for every graded notebook, its solutions, its untouched release and its wrong-answer submissions.

    All submissions are spread over SCRATCH_COURSES scratch courses graded side by side (one nbgrader
    run per course and assignment, one kernel at a time per run; the notebooks' own tensors use one
    thread). Returns {"<assignment>/<notebook>": Grades}.
    """
    jobs = []
    for notebook in GRADED:
        submissions = {"solutions": nbformat.read(notebook.source, as_version=4),
                       "untouched": nbformat.read(notebook.student_version, as_version=4)}
        submissions.update({student: answered(notebook, names) for student, names in WRONG_SUBMISSIONS[str(notebook)].items()})
        jobs += [(notebook, student, nb) for student, nb in submissions.items()]
    assignment_ids = sorted({notebook.assignment for notebook in GRADED})
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
    results = {str(notebook): Grades({}, {}) for notebook in GRADED}
    for (notebook, student), course in course_of.items():
        grades = results[str(notebook)]
        grades.scores[student] = by_course[course][student][notebook.assignment][notebook.name]
        nb = nbformat.read(course / "autograded" / student / notebook.assignment / f"{notebook.name}.ipynb", as_version=4)
        # Printed text only: a traceback quotes the test's source, including its success messages.
        grades.printed[student] = {grade_id(c): "".join(o.text for o in c.outputs if o.output_type == "stream")
                                   for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    return results


def test_every_graded_notebook_declares_its_wrong_answers():
    with_graded_cells = {path for path in SOURCES if points(path)}
    assert with_graded_cells == {notebook.source for notebook in GRADED}, (
        "every notebook with autograded cells needs a GradedNotebook entry (with its wrong answers) in GRADED: "
        f"{sorted(str(p.relative_to(REPO_ROOT)) for p in with_graded_cells ^ {n.source for n in GRADED})}")


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_wrong_answers_name_a_solution_cell_and_its_test_cell(notebook):
    cells = {grade_id(c): c.metadata.nbgrader for c in nbformat.read(notebook.source, as_version=4).cells if grade_id(c)}
    for name, (solution_cell, test_cell, edits) in notebook.wrong_answers.items():
        assert cells.get(solution_cell, {}).get("solution"), f"{notebook}, {name}: {solution_cell} is not a solution cell"
        assert cells.get(test_cell, {}).get("grade"), f"{notebook}, {name}: {test_cell} is not an autograded test cell"
        assert edits and all(right != wrong for right, wrong in edits), f"{notebook}, {name}: no edit"


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
    edited.write_text(edited.read_text().replace("raise NotImplementedError()", "pass", 1))
    shutil.copyfile(edited, tmp_path / "notebooks" / assignment / "99_no_source.ipynb")
    assert grading.compare_release(fresh_release, tmp_path) == [
        f"notebooks/{assignment}/{name}.ipynb", f"notebooks/{assignment}/99_no_source.ipynb"]


def test_release_twice_gives_identical_files(fresh_release, tmp_path):
    assert {p.relative_to(fresh_release) for p in fresh_release.rglob("*.ipynb")} == \
        {s.relative_to(REPO_ROOT / "solutions") for s in SOURCES}
    shutil.copytree(fresh_release, tmp_path, dirs_exist_ok=True)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert grading.release(REPO_ROOT, tmp_path) == [], "releasing again changed files"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


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
            assert "raise NotImplementedError()" in cell.source, f"{released}, {grade_id(cell)}: no code stub"


# ------------------------------------------------------------------ autograde

@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_solutions_score_full_marks(graded, notebook):
    grades, expected = graded[str(notebook)], points(notebook.source)
    got = grades.scores["solutions"]
    assert set(got) == set(expected), f"graded cells {sorted(got)} != test cells of the notebook {sorted(expected)}"
    lost = {cell: score for cell, score in got.items() if score != (expected[cell], expected[cell])}
    assert not lost, f"{notebook}: the solutions lose points: {lost}\n{ {c: grades.printed['solutions'][c] for c in lost} }"


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_untouched_release_scores_zero_on_every_graded_cell(graded, notebook):
    got = graded[str(notebook)].scores["untouched"]
    assert set(got) == set(points(notebook.source))
    assert all(max_score > 0 for _, max_score in got.values())
    assert {cell: score for cell, (score, _) in got.items() if score != 0} == {}


@pytest.mark.parametrize(("notebook", "name"), WRONG, ids=[f"{notebook.name}:{name}" for notebook, name in WRONG])
def test_wrong_answer_loses_exactly_its_exercise(graded, notebook, name):
    submissions = WRONG_SUBMISSIONS[str(notebook)]
    student = next(s for s, names in submissions.items() if name in names)
    wrong_cells = {notebook.wrong_answers[n][1] for n in submissions[student]}
    test_cell = notebook.wrong_answers[name][1]
    expected = points(notebook.source)
    grades = graded[str(notebook)]
    got = grades.scores[student]
    assert got[test_cell] == (0.0, expected[test_cell]), \
        f"{name}: {test_cell} should score 0, got {got[test_cell]}; it printed:\n{grades.printed[student][test_cell]}"
    others = {cell: score for cell, score in got.items() if cell not in wrong_cells and score != (expected[cell], expected[cell])}
    assert not others, f"{name}: exercises answered correctly lost points too: {others}"


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_every_exercise_has_a_wrong_answer_graded_alone(notebook):
    alone = {notebook.wrong_answers[names[0]][1] for names in WRONG_SUBMISSIONS[str(notebook)].values() if len(names) == 1}
    assert alone == set(points(notebook.source))


@pytest.mark.parametrize("notebook", GRADED, ids=str)
def test_hidden_tests_of_every_exercise_catch_a_wrong_answer_the_visible_tests_miss(graded, notebook):
    """For each exercise, some wrong answer passes the visible tests and is caught only by the hidden ones."""
    caught_by_hidden = set()
    for student, names in WRONG_SUBMISSIONS[str(notebook)].items():
        for name in names:
            test_cell = notebook.wrong_answers[name][1]
            printed = graded[str(notebook)].printed[student][test_cell]
            if "visible tests passed" in printed and "hidden tests passed" not in printed:
                caught_by_hidden.add(test_cell)
    missing = sorted(set(points(notebook.source)) - caught_by_hidden)
    assert not missing, f"{notebook}: no wrong answer is caught by the hidden tests alone for: {missing}"


def test_score_table(graded):
    by_assignment = {}
    for notebook in GRADED:  # an assignment may hold several graded notebooks
        by_assignment.setdefault(notebook.assignment, {})[notebook.name] = graded[str(notebook)].scores["solutions"]
    scores = {"solutions": by_assignment}
    table = grading.format_scores(scores)
    rows = [line.split() for line in table.splitlines()]
    for notebook in GRADED:
        total = f"{sum(points(notebook.source).values()):g}"
        assert ["solutions", notebook.assignment, notebook.name, "TOTAL", total, "/", total] in rows, table
        assert {row[3] for row in rows[1:] if row[2] == notebook.name} == set(points(notebook.source)) | {"TOTAL"}, table

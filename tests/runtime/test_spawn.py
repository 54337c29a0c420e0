"""spawnable: functions written in a notebook cell run on real ranks; the grading workers match one process.

    .venv/bin/python -m pytest -q tests/runtime/test_spawn.py

The "notebook cell" here is source text exec'd into a namespace at import time, with its text registered
in linecache under a made-up file name, which is what IPython does with every cell it runs.
"""

from __future__ import annotations

import linecache
import math
import os
import subprocess
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.core.model import GPT, GPTConfig
from course_lib.core.steps import train_step
from course_lib.data_parallel.workers import (
    FROZEN,
    check_gradient_averaging,
    check_train_step,
    gradient_averaging_reference,
    train_steps_one_process,
)
from course_lib.runtime import spawn
from course_lib.runtime.launch import RankFailure, launch
from course_lib.runtime.spawn import call, single_process_group, spawnable

CELL = '''
def rank_report(scale):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "sum": total.item() * scale, "sqrt": math.sqrt(dist.get_world_size())}


def data_parallel_backward(model, idx):
    _, loss = model(idx, targets=idx)
    loss.backward()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
    return loss.detach()


def squares(n):
    return [i * i for i in range(n)]


def uses_a_notebook_helper(x):
    return [helper(v) for v in x]


def helper(v):
    return v


def make_closure(k):
    def scaled(x):
        return k * x
    return scaled


def fails_on_purpose(x):
    if x > 2:
        raise ValueError(f"on purpose: {x}")
    return x
'''
RAISING_LINE = CELL.splitlines().index('        raise ValueError(f"on purpose: {x}")') + 1  # its line in the cell


def run_cell(source: str, filename: str, register: bool = True) -> dict:
    """exec `source` as a notebook cell would run (its text in linecache when register is True)."""
    if register:
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": "__main__"}
    exec("import math\nimport torch\nimport torch.distributed as dist\n", namespace)
    exec(compile(source, filename, "exec"), namespace)
    return namespace


NOTEBOOK = run_cell(CELL, "<notebook-cell-1>")


# ------------------------------------------------------------------ spawnable, in this process

def test_copy_is_importable_and_behaves_like_the_original():
    copy = spawnable(NOTEBOOK["squares"])
    assert copy is not NOTEBOOK["squares"] and copy.__module__.startswith("_notebook_squares_")
    assert copy(5) == NOTEBOOK["squares"](5) == [0, 1, 4, 9, 16]
    assert spawnable(NOTEBOOK["squares"]) is copy, "the same source must map to the same module"


def test_tracebacks_name_the_notebook_function_and_its_cell_line_not_a_temporary_file():
    copy = spawnable(NOTEBOOK["fails_on_purpose"])
    assert copy(1) == 1 and spawn.display_name(copy) == "<notebook function fails_on_purpose>"
    with pytest.raises(ValueError) as info:
        copy(3)
    text = "".join(traceback.format_exception(info.value))
    assert f'File "<notebook function fails_on_purpose>", line {RAISING_LINE}, in fails_on_purpose' in text, text
    assert 'raise ValueError(f"on purpose: {x}")' in text, "the traceback quotes the line that raised"
    frames = [line for line in text.splitlines() if line.strip().startswith("File ") and __file__ not in line]
    assert spawn._FOLDER_PREFIX not in text and not any(tempfile.gettempdir() + "/" in f for f in frames), text
    module = sys.modules[copy.__module__]
    assert {n for n in vars(module) if not n.startswith("__")} == {
        "math", "nullcontext", "torch", "dist", "nn", "F", "fails_on_purpose"}, "the copy's globals are the imports"


def test_functions_of_real_modules_are_returned_unchanged():
    assert spawnable(train_step) is train_step


def test_lambda_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="lambda"):
        spawnable(lambda x: x)


def test_closure_is_refused_naming_its_variables():
    with pytest.raises(TypeError, match=r"closure.*\['k'\]"):
        spawnable(NOTEBOOK["make_closure"](3))


def test_notebook_names_the_ranks_lack_are_named():
    with pytest.raises(ValueError, match=r"\['helper'\].*ranks will not have"):
        spawnable(NOTEBOOK["uses_a_notebook_helper"])


def test_function_without_source_is_refused():
    hidden = run_cell("def no_source(x):\n    return x\n", "<never-registered>", register=False)
    with pytest.raises(ValueError, match="cannot find the source code of no_source"):
        spawnable(hidden["no_source"])


def test_not_a_function_is_refused():
    with pytest.raises(TypeError, match="defined with `def`"):
        spawnable(math.sqrt)


def test_folders_of_ended_processes_are_removed():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    prefix = spawn._FOLDER_PREFIX
    dead = tempfile.mkdtemp(prefix=f"{prefix}{int(ended.stdout)}-")
    alive = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    try:
        spawn._remove_folders_of_ended_processes()
        assert not os.path.exists(dead) and os.path.isdir(alive)
    finally:
        os.rmdir(alive)


def test_single_process_group_builds_ddp_and_is_removed():
    with single_process_group():
        ddp = DistributedDataParallel(GPT(GPTConfig.from_preset("tiny")))
        assert dist.get_world_size() == 1 and next(iter(ddp.state_dict())).startswith("module.")
    assert not dist.is_initialized()


def test_one_process_references_agree_with_the_library():
    reference = gradient_averaging_reference(2)
    assert all(reference["frozen"][name] is None for name in FROZEN)
    assert all(g is not None for g in reference["all"].values())
    mine = train_steps_one_process(train_step, world_size=2, grad_clip=0.05)
    library = train_steps_one_process(world_size=2, grad_clip=0.05)
    assert mine["records"] == library["records"]
    assert [r["lr"] for r in library["records"]] == [0.5, 0.5, 0.275]  # warmup 1 step, cosine to 0.05 at step 3


# ------------------------------------------------------------------ on real ranks

@pytest.mark.distributed
def test_notebook_function_runs_under_launch(tmp_path):
    results = launch(call, 3, args=(spawnable(NOTEBOOK["rank_report"]), 2.0), log_dir=tmp_path, echo=False,
                     threads_per_rank=1)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["sum"] for r in results} == {12.0}  # (1 + 2 + 3) * 2 on every rank
    assert {r["sqrt"] for r in results} == {math.sqrt(3)}


@pytest.mark.distributed
def test_a_rank_failure_names_the_notebook_function_not_its_temporary_file(tmp_path):
    with pytest.raises(RankFailure) as info:
        launch(call, 2, args=(spawnable(NOTEBOOK["fails_on_purpose"]), 3), log_dir=tmp_path, echo=False,
               threads_per_rank=1)
    report = str(info.value)
    assert f'File "<notebook function fails_on_purpose>", line {RAISING_LINE}, in fails_on_purpose' in report, report
    assert 'raise ValueError(f"on purpose: {x}")' in report and spawn._FOLDER_PREFIX not in report, report


@pytest.mark.distributed
def test_gradient_averaging_check_matches_one_process(tmp_path):
    ranks = launch(check_gradient_averaging, 2, args=(spawnable(NOTEBOOK["data_parallel_backward"]),),
                   log_dir=tmp_path, echo=False, threads_per_rank=1)
    reference = gradient_averaging_reference(2)
    for rank in ranks:
        for case in ("all", "frozen"):
            assert rank[case]["error"] is None
            assert rank[case]["returned_loss"] == pytest.approx(rank[case]["local_loss"])
            for name, expected in reference[case].items():
                if expected is None:
                    assert rank[case]["grads"][name] is None
                else:
                    torch.testing.assert_close(rank[case]["grads"][name], expected)
    assert ranks[0]["all"]["local_loss"] != ranks[1]["all"]["local_loss"], "each rank must see its own rows"


@pytest.mark.distributed
def test_train_step_check_matches_one_process_and_counts_allreduces(tmp_path):
    ranks = launch(check_train_step, 2, args=(spawnable(train_step),), log_dir=tmp_path, echo=False,
                   threads_per_rank=1)
    reference = train_steps_one_process(world_size=2)
    for rank in ranks:
        assert rank["allreduces_per_backward"] >= 1
        assert rank["allreduces_per_step"] == [rank["allreduces_per_backward"]] * 3  # no_sync: once per step
        for got, expected in zip(rank["records"], reference["records"]):
            assert got["lr"] == expected["lr"] and got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        for name, param in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], param)
    for step, expected in enumerate(reference["records"]):
        mean = sum(rank["records"][step]["loss"] for rank in ranks) / len(ranks)
        assert mean == pytest.approx(expected["loss"], rel=1e-5)

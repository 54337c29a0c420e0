"""Every layout the course teaches, through the one front door: `python -m course_lib.train` with layout flags on
2, 4 and 8 CPU ranks. Each layout's losses and gradient norms equal one process's (the same global batch), and a
run resumed from its step-2 checkpoint continues bit for bit.

    .venv/bin/python -m pytest -q tests/parallel/test_layouts.py

One launch per world size runs all its layouts one after another (course_lib.runtime.launch.run_each).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from course_lib.checkpoint.distributed import load_distributed_checkpoint
from course_lib.parallel import Layout
from course_lib.runtime.launch import launch, run_each
from course_lib.train import Checkpoints, TrainConfig, build_parser, config_from_args, run_cli, train

STEPS, GLOBAL_BATCH = 4, 8
COMMON = dict(dataset="synthetic", model_size="tiny", block_size=32, max_steps=STEPS, eval_interval=0, eval_batches=2,
              ckpt_interval=2, warmup_steps=1, progress=False, tensorboard=False, threads=1)
LAYOUTS = {  # world size -> {name: flags}; every layout sees GLOBAL_BATCH rows per step
    2: {"ddp": ["--dp", "2"], "ddp scratch": ["--dp", "2", "--ddp", "scratch"], "zero1": ["--zero", "1"],
        "zero2": ["--zero", "2"], "zero3": ["--zero", "3"], "fsdp": ["--fsdp"], "tp": ["--tp", "2"],
        "tp+sp": ["--tp", "2", "--sp"], "pp 1f1b": ["--pp", "2", "--micro_batches", "4"],
        "pp gpipe": ["--pp", "2", "--schedule", "gpipe", "--micro_batches", "2"]},
    4: {"dp x tp": ["--dp", "2", "--tp", "2"], "dp x pp": ["--pp", "2", "--micro_batches", "2"],
        "fsdp x tp": ["--tp", "2", "--fsdp"]},
    8: {"dp x tp x pp": ["--dp", "2", "--tp", "2", "--pp", "2", "--micro_batches", "2"]},
}


def argv(out_dir, flags, replicas: int, resume=None) -> list[str]:
    args = [f"--{k}={v}" for k, v in COMMON.items() if not isinstance(v, bool)]
    args += ["--no-progress", "--no-tensorboard", f"--batch_size={GLOBAL_BATCH // replicas}",
             f"--out_dir={out_dir}", f"--log_dir={out_dir}/logs", *flags]
    return args + ([f"--resume={resume}"] if resume else [])


def layout_of(flags: list[str], world_size: int) -> Layout:
    return config_from_args(build_parser().parse_args(flags)).layout(world_size)


def step2_checkpoint(out_dir, layout: Layout):
    """Where a run of `layout` saved step 2: a file, or a folder where every rank wrote its shards."""
    distributed = Checkpoints.of(layout).kind == "distributed"
    return out_dir / ("ckpt_step000002.dcp" if distributed else "ckpt_step000002.pt")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train(TrainConfig(batch_size=GLOBAL_BATCH, out_dir=str(tmp_path_factory.mktemp("single")), **COMMON))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    """(world size, {layout: (uninterrupted run, run resumed from its step-2 checkpoint)} as rank 0 saw them)."""
    world_size = request.param
    root = tmp_path_factory.mktemp(f"layouts{world_size}")
    calls = []
    for i, flags in enumerate(LAYOUTS[world_size].values()):
        layout = layout_of(flags, world_size)
        calls.append((run_cli, {"argv": argv(root / f"{i}", flags, layout.dp)}))
        calls.append((run_cli, {"argv": argv(root / f"{i}-resumed", flags, layout.dp,
                                             resume=step2_checkpoint(root / f"{i}", layout))}))
    ranks = launch(run_each, world_size, args=(calls,), log_dir=root / "logs", threads_per_rank=1, timeout_s=180)
    return world_size, {name: (ranks[0][2 * i], ranks[0][2 * i + 1]) for i, name in enumerate(LAYOUTS[world_size])}


def test_every_layout_trains_like_one_process_and_resumes_bit_exactly(runs, one_process):
    world_size, by_layout = runs
    reference = one_process["history"]
    for name, (full, resumed) in by_layout.items():
        assert [r["step"] for r in full["history"]] == list(range(1, STEPS + 1)), name
        for key in ("loss", "grad_norm", "lr"):
            assert_close(torch.tensor([r[key] for r in full["history"]], dtype=torch.float64),
                         torch.tensor([r[key] for r in reference], dtype=torch.float64), rtol=2e-5, atol=1e-6,
                         msg=lambda m: f"{name} at {world_size} ranks, {key}: {m}")
        assert_close(full["evals"][-1]["val_loss"], one_process["evals"][-1]["val_loss"], rtol=2e-5, atol=1e-6)
        assert resumed["start_step"] == 2, name
        assert [(r["loss"], r["grad_norm"]) for r in resumed["history"]] == \
            [(r["loss"], r["grad_norm"]) for r in full["history"][2:]], f"{name}: the resumed steps differ"
        assert resumed["evals"][-1]["val_loss"] == full["evals"][-1]["val_loss"], name


def test_sharded_layouts_write_distributed_checkpoints_and_refuse_another_layout(runs):
    world_size, by_layout = runs
    for name, (full, _) in by_layout.items():
        layout_name = full["layout"]
        checkpoint = full["checkpoint"]
        if checkpoint.endswith(".dcp"):
            with pytest.raises(ValueError, match=f"written by the layout '{layout_name}'; this run is 'dp{world_size}'"):
                load_distributed_checkpoint(checkpoint, state={}, layout=f"dp{world_size}")
        else:
            assert name in ("ddp", "ddp scratch", "fsdp"), f"{name} wrote one file: {checkpoint}"


def test_help_lists_the_layout_flags():
    text = build_parser().format_help()
    for flag in ("--dp", "--tp", "--pp", "--zero", "--fsdp", "--sp", "--schedule", "--micro_batches", "--ddp"):
        assert f"{flag} " in text, flag


@pytest.mark.parametrize("fields, message", [
    (dict(zero=4), r"Layout.zero must be one of \[0, 1, 2, 3\], got 4"),
    (dict(dp=2, zero=1, fsdp=True), "choose one"),
    (dict(sp=True), "Layout.sp=True needs Layout.tp > 1"),
    (dict(tp=2, zero=2), "runs over plain data parallelism only"),
    (dict(pp=2, fsdp=True), "not supported"),
    (dict(micro_batches=4), "needs pipeline stages"),
    (dict(pp=2, schedule="zigzag"), "Layout.schedule must be one of"),
    (dict(tp=0), "Layout.tp must be a positive integer"),
    (dict(ddp="nccl"), "Layout.ddp must be one of"),
])
def test_bad_layouts_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Layout(**fields)


def test_a_layout_that_does_not_fit_the_job_names_the_ranks():
    with pytest.raises(ValueError, match=r"do not split into tp \* pp = 2 \* 2 = 4"):
        Layout.for_world(6, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"needs dp \* tp \* pp = 3 \* 1 \* 1 = 3 ranks, but the job has 2"):
        Layout.for_world(2, dp=3)
    with pytest.raises(ValueError, match="strategy='single' runs one process"):
        TrainConfig(strategy="single", tp=2)
    assert Layout.for_world(8, tp=2, pp=2).name() == "dp2 tp2 pp2 1f1b m2"

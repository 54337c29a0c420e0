"""Pipeline parallelism from scratch (course_lib.pipeline_parallel.stage): GPipe and 1F1B equal one process.

    .venv/bin/python -m pytest -q tests/pipeline_parallel/test_stage.py
"""

import pytest
import torch

from course_lib.core.model import GPT, GPTConfig
from course_lib.pipeline_parallel.schedules import (
    max_in_flight,
    measured_bubble_fraction,
    pipeline_comm_bytes,
    predicted_bubble_fraction,
    schedule_actions,
    simulate_schedule,
    with_idle,
)
from course_lib.pipeline_parallel.stage import GPTStage, PipelineRunner, split_layers
from course_lib.pipeline_parallel.workers import pipeline_train, reference_run
from course_lib.runtime.launch import launch, run_each

STEPS = 3


def assert_matches_reference(ranks, reference, run):
    """Every stage's gradients and parameters equal the full model's; the last stage's losses too."""
    covered = set()
    for rank_results in ranks:
        result = rank_results[run]
        where = f"{run}, stage {result['stage']} of {len(ranks)}"
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], msg=f"{where}: first-step grad of {name}")
        for name, param in result["params"].items():
            torch.testing.assert_close(param, reference["params"][name], msg=f"{where}: {name} after the steps")
        covered |= set(result["params"])
    assert covered == set(reference["params"]), "the stages together hold every parameter of the model"
    last = ranks[-1][run]
    # The losses were computed in fp32 (then turned into Python floats): compare them with fp32 tolerances.
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(reference["losses"]))
    assert all(r[run]["losses"] == [] for r in ranks[:-1]), "only the last stage computes the loss"


def test_split_layers_and_bad_split():
    assert [list(r) for r in split_layers(4, 3)] == [[0, 1], [2], [3]]
    assert [len(r) for r in split_layers(12, 4)] == [3, 3, 3, 3]
    with pytest.raises(ValueError, match=r"n_layer=2 blocks into 4 pipeline stages"):
        split_layers(2, 4)
    model = GPT(GPTConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=r"n_layer=2 blocks into 3 pipeline stages"):
        GPTStage(model, 0, 3)
    with pytest.raises(ValueError, match=r"stage must be in 0\.\.1"):
        GPTStage(model, 2, 2)


def test_stages_chained_in_one_process_equal_the_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", n_layer=4))
    stages = [GPTStage(model, s, 3) for s in range(3)]
    idx = torch.randint(0, 256, (2, 16))
    x = idx
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(idx)[0])
    assert stages[-1].lm_head.weight is not stages[0].tok_emb.weight  # two copies of the tied matrix
    single = GPTStage(model, 0, 1)
    assert single.lm_head.weight is single.tok_emb.weight  # one stage holds both ends: still tied


def test_one_stage_pipeline_accumulates_micro_batches_exactly():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    stage = GPTStage(model, 0, 1)
    tokens = torch.randint(0, 256, (8, 32))
    _, loss = model(tokens, targets=tokens)
    loss.backward()
    pipeline_loss = PipelineRunner(stage, "1f1b", 4).step(tokens)
    torch.testing.assert_close(pipeline_loss, loss.item(), rtol=1.3e-6, atol=1e-5)  # fp32 sums, another order
    grads = dict(stage.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, msg=name)
    with pytest.raises(ValueError, match="8 sequences cannot be split into 3"):
        PipelineRunner(stage, "gpipe", 3).step(tokens)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineRunner(stage, "zero-bubble", 2)


@pytest.mark.parametrize("n_stages, micro_batches", [(2, 1), (2, 4), (4, 8), (4, 3), (3, 16)])
def test_schedules_bubble_and_memory_in_the_ideal_pipeline(n_stages, micro_batches):
    for name in ("gpipe", "1f1b"):
        for stage in range(n_stages):
            actions = schedule_actions(name, n_stages, stage, micro_batches)
            assert sorted(actions) == sorted([("F", i) for i in range(micro_batches)] +
                                             [("B", i) for i in range(micro_batches)])
            assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(micro_batches))
            expected = micro_batches if name == "gpipe" else min(n_stages - stage, micro_batches)
            assert max_in_flight(actions) == expected
        intervals, _ = simulate_schedule(name, n_stages, micro_batches, forward_time=1.0, backward_time=2.0)
        bubble = measured_bubble_fraction(intervals)
        assert bubble == pytest.approx(predicted_bubble_fraction(n_stages, micro_batches))
        idle = sum(end - start for rank in with_idle(intervals) for kind, start, end in rank if kind == "idle")
        window = max(end for rank in intervals for _, _, end in rank)
        assert idle == pytest.approx(bubble * window * n_stages)


def test_comm_bytes_formula():
    volume = pipeline_comm_bytes(4, 8, micro_batch_size=2, seq_len=128, n_embd=64, vocab_size=256)
    assert volume["message"] == 2 * 128 * 64 * 4
    assert volume["forward"] == volume["backward"] == 3 * 8 * volume["message"]
    assert volume["tied_grad"] == 256 * 64 * 4
    assert pipeline_comm_bytes(1, 8, 2, 128, 64, vocab_size=256)["total"] == 0


def check_pipeline_run(ranks, reference, micro_batches, global_batch, seq_len, config):
    n_stages = len(ranks)
    volume = pipeline_comm_bytes(n_stages, micro_batches, global_batch // micro_batches, seq_len, config.n_embd,
                                 vocab_size=config.vocab_size)
    for run in ("scratch gpipe", "scratch 1f1b"):
        assert_matches_reference(ranks, reference, run)
        peaks = [r[run]["peak_in_flight"][0] for r in ranks]
        expected = [micro_batches] * n_stages if "gpipe" in run else [n_stages - s for s in range(n_stages)]
        assert peaks == expected, f"{run}: micro-batches in flight per stage"
        activation_bytes = [r[run]["peak_activation_bytes"][0] for r in ranks]
        assert all(b > 0 for b in activation_bytes)
        for r in ranks:  # every step sends the same bytes; the sum over stages is the formula
            assert all(sent == r[run]["bytes_sent"][0] for sent in r[run]["bytes_sent"])
        assert sum(r[run]["bytes_sent"][0]["activations"] for r in ranks) == volume["forward"]
        assert sum(r[run]["bytes_sent"][0]["activation_grads"] for r in ranks) == volume["backward"]
        tied = [r[run]["tied_grad_bytes"][0] for r in ranks]
        assert tied == [volume["tied_grad"]] + [0] * (n_stages - 2) + [volume["tied_grad"]]
        compute = [[iv for iv in r[run]["timelines"][0] if iv[0] in ("forward", "backward")] for r in ranks]
        assert all(len(c) == 2 * micro_batches for c in compute)
        assert 0 < measured_bubble_fraction(compute) < 1
    gpipe_bytes = [r["scratch gpipe"]["peak_activation_bytes"][0] for r in ranks]
    one_f_one_b_bytes = [r["scratch 1f1b"]["peak_activation_bytes"][0] for r in ranks]
    assert all(b < g for b, g in zip(one_f_one_b_bytes, gpipe_bytes)), "1F1B holds fewer activations"


@pytest.mark.distributed
# AdamW as in training; SGD on the deeper split, where AdamW would magnify last-bit differences of
# near-zero gradients (see course_lib.pipeline_parallel.workers._optimizer).
@pytest.mark.parametrize("n_stages, micro_batches, overrides, optimizer, lr",
                         [(2, 4, {}, "adamw", 1e-3), (4, 8, {"n_layer": 4}, "sgd", 0.1)])
def test_gpipe_and_1f1b_equal_one_process(tmp_path, n_stages, micro_batches, overrides, optimizer, lr):
    settings = dict(steps=STEPS, preset="tiny", config_overrides=overrides, global_batch=8, seq_len=32,
                    optimizer=optimizer, lr=lr)
    runs = {f"scratch {schedule}": (pipeline_train, dict(schedule=schedule, micro_batches=micro_batches, **settings))
            for schedule in ("gpipe", "1f1b")}
    ranks = launch(run_each, n_stages, args=(runs,), log_dir=tmp_path, echo=False, threads_per_rank=1)
    reference = reference_run(**settings)
    check_pipeline_run(ranks, reference, micro_batches, settings["global_batch"], settings["seq_len"],
                       GPTConfig.from_preset("tiny", **overrides))

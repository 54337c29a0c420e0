"""Tensor parallelism from scratch (course_lib.tensor_parallel.tp_layers) equals one process holding the whole model.

    .venv/bin/python -m pytest -q tests/tensor_parallel/test_tp_layers.py

One 4-rank job runs TP=2 (two groups of 2 ranks) and TP=4 (all ranks); every rank's logits, loss, first-step
gradients (shards gathered) and parameters after STEPS AdamW steps must equal one process, and the all-reduces
that f and g issue must match tp_allreduce_bytes_per_layer.
"""


import pytest
import torch

from course_lib.core.model import GPT, GPTConfig
from course_lib.runtime.launch import launch
from course_lib.runtime.spawn import single_process_group
from course_lib.tensor_parallel.tp_layers import (
    TP_ALLREDUCES_PER_LAYER,
    apply_tensor_parallel,
    check_tensor_parallel_config,
    tp_allreduce_bytes_per_layer,
)
from course_lib.tensor_parallel.workers import compare_with_reference, reference_run, tp_checks

STEPS, BATCH, SEQ_LEN = 3, 4, 32
TP_SIZES = (2, 4)


@pytest.fixture(scope="module")
def reference():
    return reference_run(steps=STEPS, batch=BATCH, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    runs = tuple((f"tp{tp}", dict(implementation="scratch", tp=tp)) for tp in TP_SIZES)
    return launch(tp_checks, 4, kwargs=dict(runs=runs, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN),
                  log_dir=tmp_path_factory.mktemp("tp_logs"), echo=False, timeout_s=120)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TP_SIZES)
def test_forward_gradients_and_steps_equal_one_process(reference, ranks, tp):
    n_head, ffn_hidden, n_embd = 4, 128, 64  # the tiny preset
    for rank_results in ranks:
        result = rank_results[f"tp{tp}"]
        where = f"TP={tp}, rank {result['rank']}"
        assert result["tp"] == tp
        assert result["n_local_heads"] == n_head // tp
        assert result["local_shapes"] == {"q_proj": (n_embd // tp, n_embd), "o_proj": (n_embd, n_embd // tp),
                                          "gate_proj": (ffn_hidden // tp, n_embd),
                                          "down_proj": (n_embd, ffn_hidden // tp)}
        assert result["local_params"] < reference["params_total"]
        compare_with_reference(result, reference, where)  # logits, loss, gradients, parameters after STEPS steps
        torch.testing.assert_close(result["losses"], reference["losses"], msg=f"{where}: losses")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TP_SIZES)
def test_replicated_gradients_are_identical_on_every_rank(ranks, tp):
    # f's backward all-reduce gives each rank the full gradient of the region input, so everything upstream
    # (norms, embedding) gets bit-identical gradients: no extra synchronisation is needed.
    first = ranks[0][f"tp{tp}"]
    assert {"tok_emb.weight", "norm_f.weight", "blocks.0.attn_norm.weight"} <= set(first["replicated_grads"])
    assert not any("proj" in name for name in first["replicated_grads"])
    for rank_results in ranks[1:]:
        for name, grad in rank_results[f"tp{tp}"]["replicated_grads"].items():
            assert torch.equal(grad, first["replicated_grads"][name]), f"TP={tp}: {name} differs across ranks"


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TP_SIZES)
def test_measured_communication_equals_formula(ranks, tp):
    n_layer, n_embd = 2, 64
    for rank_results in ranks:
        result = rank_results[f"tp{tp}"]
        assert result["first_step_calls"] == {phase: n * n_layer for phase, n in TP_ALLREDUCES_PER_LAYER.items()}
        measured = sum(result["first_step_bytes"].values())
        assert measured == result["formula_bytes_per_step"] == n_layer * 4 * BATCH * SEQ_LEN * n_embd * 4
        assert result["inference_calls"] == 2 * n_layer  # no backward: g only
        assert result["inference_bytes"] == measured // 2


def test_comparison_catches_a_wrong_gradient_or_step(reference):
    assert max(compare_with_reference(reference, reference).values()) == 0
    for key, name in (("grads", "blocks.0.attn.q_proj.weight"), ("params", "blocks.1.mlp.down_proj.weight")):
        wrong = {**reference, key: dict(reference[key])}
        scale = reference["lr"] if key == "params" else reference[key][name].abs().max().item()
        wrong[key][name] = reference[key][name] + scale * (torch.rand_like(reference[key][name]) - 0.5)
        with pytest.raises(AssertionError, match=name):
            compare_with_reference(wrong, reference)


def test_allreduce_bytes_formula():
    assert tp_allreduce_bytes_per_layer(2, 8, 16) == 4 * 2 * 8 * 16 * 4
    assert tp_allreduce_bytes_per_layer(2, 8, 16, element_size=2) == tp_allreduce_bytes_per_layer(2, 8, 16) // 2
    with pytest.raises(ValueError, match="seq_len"):
        tp_allreduce_bytes_per_layer(2, 0, 16)


def test_divisibility_errors_name_the_field():
    with pytest.raises(ValueError, match="n_head"):
        check_tensor_parallel_config(GPTConfig(n_head=4, n_embd=64), 3)
    with pytest.raises(ValueError, match="ffn_hidden"):
        check_tensor_parallel_config(GPTConfig(n_head=4, n_embd=64, ffn_hidden=130), 4)
    check_tensor_parallel_config(GPTConfig(n_head=4, n_embd=64, ffn_hidden=128), 4)


def test_apply_on_one_rank_is_the_same_model_and_rejects_misuse():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    tokens = torch.randint(0, 256, (2, 16))
    expected, _ = model(tokens)
    with single_process_group():
        stats = apply_tensor_parallel(model).tp_stats
        torch.testing.assert_close(model(tokens)[0], expected)
        assert stats.calls["forward"] == 2 * model.config.n_layer
        with pytest.raises(RuntimeError, match="already tensor-parallel"):
            apply_tensor_parallel(model)
        with pytest.raises(TypeError, match="GPT"):
            apply_tensor_parallel(torch.nn.Linear(4, 4))

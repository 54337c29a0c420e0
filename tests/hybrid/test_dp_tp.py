"""Data parallel x tensor parallel on a (2, 2) device mesh equals one process on the whole global batch, with
either data-parallel variant; the groups are the ones course_lib.hybrid.layout computes; TP issues Megatron's
4 all-reduces per layer. One launch of 4 ranks (about 15-30 s on 2 cores)."""

import copy

import pytest

from course_lib.core.model import GPTConfig
from course_lib.hybrid.dp_tp import DATA_PARALLEL, check_parity, dp_tp_run
from course_lib.hybrid.layout import rank_groups
from course_lib.runtime.launch import launch, run_each
from course_lib.parity import single_process_run

STEPS, PRESET = 3, "tiny"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    runs = {variant: (dp_tp_run, dict(data_parallel=variant, dp=2, tp=2, steps=STEPS, preset=PRESET))
            for variant in DATA_PARALLEL}
    return launch(run_each, 4, args=(runs,), log_dir=tmp_path_factory.mktemp("logs"), echo=False, threads_per_rank=1)


@pytest.fixture(scope="module")
def reference():
    return single_process_run(steps=STEPS, preset=PRESET)


@pytest.mark.distributed
@pytest.mark.parametrize("data_parallel", DATA_PARALLEL)
def test_dp_x_tp_equals_one_process(ranks, reference, data_parallel):
    results = [r[data_parallel] for r in ranks]
    worst = check_parity(results, reference)
    assert set(worst) == {"grads", "params", "loss"}
    # The two replicas saw different rows, so their local losses differ; their mean was checked above.
    assert results[0]["losses"] != results[2]["losses"] and results[0]["losses"] == results[1]["losses"]


@pytest.mark.distributed
def test_groups_shards_and_tp_collectives(ranks):
    config = GPTConfig.from_preset(PRESET)
    places = rank_groups(4, tp=2, pp=1)
    for rank, result in enumerate(r["allreduce"] for r in ranks):
        assert result["coords"] == {"dp": places[rank].dp, "tp": places[rank].tp}
        assert result["groups"] == {"dp": places[rank].dp_group, "tp": places[rank].tp_group}
        C, F = config.n_embd, config.ffn_hidden
        assert result["local_shapes"] == {  # column-parallel: rows (outputs) split; row-parallel: columns
            "attn.q_proj.weight": (C // 2, C), "attn.k_proj.weight": (C // 2, C), "attn.v_proj.weight": (C // 2, C),
            "attn.o_proj.weight": (C, C // 2), "mlp.gate_proj.weight": (F // 2, C),
            "mlp.up_proj.weight": (F // 2, C), "mlp.down_proj.weight": (C, F // 2)}
        # Megatron's count: per layer 2 all-reduces in forward (after o_proj, down_proj), 2 in backward.
        assert result["tp_collectives"]["forward"] == {"all_reduce": 2 * config.n_layer}
        assert result["tp_collectives"]["forward_backward"] == {"all_reduce": 4 * config.n_layer}


@pytest.mark.distributed
def test_check_parity_catches_a_wrong_rank(ranks, reference):
    results = copy.deepcopy([r["allreduce"] for r in ranks])
    results[3]["params"]["blocks.1.mlp.down_proj.weight"][0, 0] += 1e-3
    with pytest.raises(AssertionError, match=r"rank 3 .*params blocks\.1\.mlp\.down_proj\.weight"):
        check_parity(results, reference)
    results = copy.deepcopy([r["allreduce"] for r in ranks])
    results[1]["losses"][0] += 1e-3
    with pytest.raises(AssertionError, match="tp ranks of replica 0 disagree"):
        check_parity(results, reference)


def test_bad_data_parallel_mode_is_refused():
    with pytest.raises(ValueError, match="data_parallel must be one of"):
        dp_tp_run(data_parallel="ddp")

"""The 1000-GPU planner: each formula on a case small enough to do by hand, how a plan combines them, and the
errors for layouts that cannot exist."""

import math

import pytest

from course_lib.hybrid import planner as scale_planner
from course_lib.hybrid.planner import (
    MODELS,
    Cluster,
    Layout,
    ModelShape,
    best,
    candidate_layouts,
    check_layout,
    cp_bytes_per_gpu,
    ep_bytes_per_gpu,
    stage_expert_params,
    pipeline_bubble,
    plan,
    pp_bytes_per_gpu,
    stage_params,
    tp_bytes_per_gpu,
)
from course_lib.memory.accounting import count_parameters
from course_lib.memory.activations import korthikanti_bytes_per_layer
from course_lib.memory.formulas import data_parallel_traffic, zero_memory_per_gpu

# 4 layers, h = 8, 2 heads, 2 nodes x 4 GPUs: every number below can be checked on paper.
TOY = ModelShape("toy", n_layer=4, n_embd=8, n_head=2, ffn_hidden=16, vocab_size=16)
TOY_CLUSTER = Cluster(n_nodes=2, gpus_per_node=4, gpu_memory=1e6, usable_fraction=1.0, peak_flops=1e9,
                      compute_efficiency=0.5, intra_node_busbw=100.0, inter_node_busbw=10.0)


def sp_bytes(seq_len, batch, hidden, heads, tp=1, recompute="selective"):
    """The planner's activation term: Korthikanti with sequence parallelism."""
    return korthikanti_bytes_per_layer(seq_len, batch, hidden, heads, tp=tp, sequence_parallel=True,
                                       recompute=recompute)


def test_activation_memory_per_layer():
    # s = 2, b = 1, h = 4, a = 2: s b h = 8; 5 a s / h = 5.
    assert sp_bytes(2, 1, 4, 2, tp=1, recompute="none") == 8 * (34 + 5)
    assert sp_bytes(2, 1, 4, 2, tp=2, recompute="none") == 8 * (34 + 5) / 2
    assert sp_bytes(2, 1, 4, 2, tp=2, recompute="selective") == 8 * 34 / 2
    assert sp_bytes(2, 3, 4, 2, tp=1, recompute="full") == 2 * 24
    # The 5 a s / h term (attention scores) grows with the sequence: it dominates long contexts.
    long = sp_bytes(4096, 1, 8192, 64, recompute="none")
    assert long / sp_bytes(4096, 1, 8192, 64, recompute="selective") == (34 + 160) / 34


def test_pipeline_bubble():
    assert pipeline_bubble(1, 8) == 0
    assert pipeline_bubble(4, 12) == 3 / 15
    assert pipeline_bubble(8, 1) == 7 / 8  # one micro-batch: all but one stage idle
    with pytest.raises(ValueError, match="n_micro must be a positive integer"):
        pipeline_bubble(4, 0)


def test_communication_volumes():
    # 2 layers x 1 micro-batch x 4 all-reduces x 2 (t-1)/t = 1 x (b s h = 32 values x 2 bytes)
    assert tp_bytes_per_gpu(2, 1, 1, 4, 8, tp=2) == 2 * 4 * 1 * 64
    assert tp_bytes_per_gpu(2, 1, 1, 4, 8, tp=1) == 0
    # 3 micro-batches x (activation forward + gradient backward) x 64 bytes / tp
    assert pp_bytes_per_gpu(3, 1, 4, 8, tp=2, pp=2) == 3 * 2 * 64 / 2
    assert pp_bytes_per_gpu(3, 1, 4, 8, tp=2, pp=1) == 0


def test_stage_parameters():
    assert stage_params(TOY, tp=1, pp=1) == TOY.n_params == count_parameters(TOY.config(8))
    per_layer = 4 * 8 * 8 + 3 * 8 * 16
    assert stage_params(TOY, tp=2, pp=2) == 2 * (per_layer / 2 + 2 * 8) + 16 * 8 / 2
    for name, size in [("7B", 6.6e9), ("70B", 70e9), ("175B", 175e9)]:
        assert abs(MODELS[name].n_params / size - 1) < 0.01, (name, MODELS[name].n_params)


def test_plan_combines_the_formulas():
    layout = Layout(dp=2, tp=2, pp=2, zero_stage=1)
    p = plan(TOY, layout, TOY_CLUSTER, seq_len=4, global_batch=8)
    assert p.n_micro == 4  # 8 sequences / (dp 2 x micro-batch 1)
    params = stage_params(TOY, 2, 2)
    assert p.model_states == zero_memory_per_gpu(params, 2, 1)
    assert p.activations == 2 * 2 * sp_bytes(4, 1, 8, 2, 2)  # 2 layers x 2 in flight
    assert p.traffic == {"dp": data_parallel_traffic(params, 2), "tp": tp_bytes_per_gpu(2, 4, 1, 4, 8, 2),
                         "pp": pp_bytes_per_gpu(4, 1, 4, 8, 2, 2), "cp": 0.0, "ep": 0.0}
    assert p.bubble == 1 / 5
    # Order (dp, pp, tp): tp and pp groups {0, 1}, {0, 2} sit in node 0; the dp group {0, 4} spans two nodes.
    assert p.seconds["tp"] == p.traffic["tp"] / 100 and p.seconds["pp"] == p.traffic["pp"] / 100
    assert p.seconds["dp"] == p.traffic["dp"] / 10
    flops = (6 * TOY.n_params + 12 * 4 * 8 * 4) * 8 * 4
    compute = flops / (8 * 1e9 * 0.5)
    assert math.isclose(p.seconds["compute"], compute / (1 - 1 / 5))
    assert math.isclose(p.seconds["dp_exposed"], max(0.0, p.seconds["dp"] - 2 / 3 * compute / 4))
    assert math.isclose(p.seconds["step"], p.seconds["compute"] + p.seconds["tp"] + p.seconds["pp"]
                        + p.seconds["dp_exposed"]) and p.seconds["cp"] == p.seconds["ep"] == 0
    assert math.isclose(p.mfu, flops / (p.seconds["step"] * 8 * 1e9))
    assert p.fits == (p.total <= 1e6) and p.total == p.model_states.total + p.activations


def test_zero3_gathers_every_micro_batch_and_pipelining_keeps_activations_flat():
    one = plan(TOY, Layout(dp=8, tp=1, pp=1, zero_stage=3), TOY_CLUSTER, seq_len=4, global_batch=16)
    assert one.n_micro == 2
    assert one.traffic["dp"] == 2 * data_parallel_traffic(TOY.n_params, 8, strategy="zero3")
    # 1F1B: pp stages of L / pp layers, pp micro-batches in flight on the first: L layers' worth, whatever pp.
    acts = [plan(TOY, Layout(dp=8 // pp, tp=1, pp=pp), TOY_CLUSTER, seq_len=4, global_batch=16).activations
            for pp in (1, 2, 4)]
    assert acts[1] == acts[2] == 4 * sp_bytes(4, 1, 8, 2, 1)


def test_context_parallelism_divides_activations_and_sends_its_ring():
    base = plan(TOY, Layout(dp=8, tp=1, pp=1), TOY_CLUSTER, seq_len=8, global_batch=16)
    ring = plan(TOY, Layout(dp=4, tp=1, pp=1, cp=2), TOY_CLUSTER, seq_len=8, global_batch=16)
    assert ring.activations == base.activations / 2  # s/2 queries per GPU, each against all s keys
    # 4 layers x 4 micro-batches x (1 forward + 2 x 1 + 1 backward) blocks of k and v, each 2 x 1 x 4 x 8 x 2 bytes
    assert ring.traffic["cp"] == cp_bytes_per_gpu(4, 4, 1, 8, 8, 1, 2) == 4 * 4 * 4 * 2 * 1 * 4 * 8 * 2
    assert base.traffic["cp"] == 0 and ring.traffic["tp"] == 0
    params = stage_params(TOY, 1, 1)
    assert ring.model_states == zero_memory_per_gpu(params, 8, 1)  # replicated over dp x cp = 8 GPUs
    assert ring.traffic["dp"] == data_parallel_traffic(params, 8)
    # order (dp, pp, cp, tp): the cp group {0, 1} sits in node 0
    assert ring.seconds["cp"] == ring.traffic["cp"] / 100
    with pytest.raises(ValueError, match=r"seq_len \(6\) must split into 2 x cp = 4 equal chunks"):
        plan(TOY, Layout(dp=4, tp=1, pp=1, cp=2), TOY_CLUSTER, seq_len=6, global_batch=16)
    with pytest.raises(ValueError, match=r"dp \* tp \* pp \* cp = 2 \* 1 \* 1 \* 2 must equal the cluster's 8 GPUs"):
        plan(TOY, Layout(dp=2, tp=1, pp=1, cp=2), TOY_CLUSTER, seq_len=8, global_batch=16)
    long = [p for p in (plan(MODELS["70B"], layout, seq_len=131072, global_batch=64)
                        for layout in candidate_layouts(MODELS["70B"], global_batch=64, cps=(1, 8)))]
    assert not any(p.fits for p in long if p.layout.cp == 1) and any(p.fits for p in long if p.layout.cp == 8)


TOY_MOE = ModelShape("toy moe", n_layer=4, n_embd=8, n_head=2, ffn_hidden=16, vocab_size=16, n_experts=4, top_k=2,
                     capacity_factor=1.0)


def test_expert_parallelism_shards_the_experts_and_sends_two_all_to_alls_each_way():
    dense = count_parameters(TOY.config(1))
    expert = 3 * 8 * 16
    assert TOY_MOE.n_params == dense + 4 * (3 * expert + 8 * 4)  # 3 more experts and a router per layer
    assert TOY_MOE.active_params == dense + 4 * (1 * expert + 8 * 4)  # top-2: one more expert per token
    one = plan(TOY_MOE, Layout(dp=8, tp=1, pp=1), TOY_CLUSTER, seq_len=4, global_batch=16)
    four = plan(TOY_MOE, Layout(dp=8, tp=1, pp=1, ep=4), TOY_CLUSTER, seq_len=4, global_batch=16)
    assert stage_expert_params(TOY_MOE, 1, 4) == 4 * 1 * expert and stage_expert_params(TOY, 1, 4) == 0
    assert four.params_per_gpu == one.params_per_gpu - 4 * 3 * expert  # 1 expert per layer instead of 4
    states = zero_memory_per_gpu(four.params_per_gpu - 4 * expert, 8, 1)
    experts = zero_memory_per_gpu(4 * expert, 2, 1)  # each expert replicated over dp / ep = 2 GPUs
    assert four.model_states.total == states.total + experts.total
    # 4 layers x 2 micro-batches x 4 all-to-alls x (1.0 x 2 x 1 x 4 x 8) values x 2 bytes x 3/4
    assert four.traffic["ep"] == ep_bytes_per_gpu(TOY_MOE, 4, 2, 1, 4, 1, 4) == 4 * 2 * 4 * 64 * 2 * 3 / 4
    assert one.traffic["ep"] == 0 and four.traffic["dp"] < one.traffic["dp"]
    assert four.seconds["ep"] == four.traffic["ep"] / 100  # ranks 0-3: one node
    flops = (6 * TOY_MOE.active_params + 12 * 4 * 8 * 4) * 16 * 4
    assert math.isclose(four.mfu, flops / (four.seconds["step"] * 8 * 1e9))
    with pytest.raises(ValueError, match=r"ep \(2\) splits experts, and toy has none"):
        plan(TOY, Layout(dp=8, tp=1, pp=1, ep=2), TOY_CLUSTER, seq_len=4, global_batch=16)
    with pytest.raises(ValueError, match=r"ep \(3\) must divide n_experts \(4\)"):
        plan(TOY_MOE, Layout(dp=8, tp=1, pp=1, ep=3), TOY_CLUSTER, seq_len=4, global_batch=16)


def test_tp_across_nodes_is_flagged_and_slow():
    inside = plan(MODELS["70B"], Layout(dp=128, tp=8, pp=1))
    across = plan(MODELS["70B"], Layout(dp=64, tp=16, pp=1))
    assert not inside.tp_crosses_nodes and across.tp_crosses_nodes
    assert inside.seconds["tp"] == inside.traffic["tp"] / scale_planner.H100_CLUSTER.intra_node_busbw
    assert across.seconds["tp"] == across.traffic["tp"] / scale_planner.H100_CLUSTER.inter_node_busbw
    assert best([inside, across]) is inside


def test_what_fits_on_80_gb():
    plans = [plan(MODELS["175B"], layout) for layout in candidate_layouts(MODELS["175B"])]
    assert len(plans) == 25  # tp and pp in 1, 2, 4, 8, 16: all divide 96 heads / layers and 1024 GPUs
    pure_dp = next(p for p in plans if p.layout.tp == p.layout.pp == 1)
    assert not pure_dp.fits and pure_dp.model_states.params == 2 * stage_params(MODELS["175B"], 1, 1)
    chosen = best(plans)
    assert chosen.fits and chosen.total <= 0.9 * 80e9 and chosen.layout.tp <= 8
    assert all(p.seconds["step"] >= chosen.seconds["step"] for p in plans if p.fits and not p.tp_crosses_nodes)


@pytest.mark.parametrize(("layout", "message"), [
    (Layout(dp=2, tp=2, pp=1), r"world_size \(8\) must equal dp \* tp \* pp = 2 \* 2 \* 1 = 4"),
    (Layout(dp=2, tp=4, pp=1), r"tp \(4\) must divide n_head \(2\)"),
    (Layout(dp=1, tp=1, pp=8), r"pp \(8\) cannot exceed n_layer \(4\)"),
    (Layout(dp=8, tp=1, pp=1), r"global_batch \(12\) must be divisible by dp x micro_batch = 8 x 1"),
    (Layout(dp=4, tp=2, pp=1, zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
])
def test_invalid_layouts(layout, message):
    with pytest.raises(ValueError, match=message):
        check_layout(TOY, layout, TOY_CLUSTER, global_batch=12)
    with pytest.raises(ValueError, match=message):
        plan(TOY, layout, TOY_CLUSTER, seq_len=4, global_batch=12)


def test_unknown_recompute():
    with pytest.raises(ValueError, match="recompute must be one of"):
        sp_bytes(4, 1, 8, 2, recompute="some")


def test_command_line_plans_a_mixture_of_experts(capsys):
    scale_planner.main(["--model", "8x7B", "--ep", "1", "8", "--fits-only"])
    out = capsys.readouterr().out
    assert "8x7B:" in out and "best estimate: tp=" in out and " ep=8 " in out


def test_command_line(capsys):
    scale_planner.main(["--model", "7B", "70B", "--fits-only"])
    out = capsys.readouterr().out
    assert out.count("best estimate: tp=") == 2 and "128 nodes x 8 GPUs of 80 GB" in out
    assert not [line for line in out.splitlines() if line.startswith(" 16 ")]  # --fits-only drops tp across nodes
    assert [line for line in out.splitlines() if line.startswith("  8 ")]

"""Tensor parallelism with torch DTensor (course_lib.tensor_parallel.dtensor) equals one process, in three plans.

    .venv/bin/python -m pytest -q tests/tensor_parallel/test_dtensor.py

One 2-rank job: ColwiseParallel/RowwiseParallel with the region input made a DTensor once (Megatron's 2 + 2
all-reduces per layer), the same without it (one backward all-reduce per column-parallel projection), and
sequence parallelism (all-gather + reduce-scatter instead of all-reduce). Each must equal one process in
logits, loss, gradients and parameters after STEPS AdamW steps.
"""

import pytest
import torch

from course_lib.runtime.launch import launch
from course_lib.tensor_parallel.workers import DEFAULT_RUNS, compare_with_reference, reference_run, tp_checks

pytestmark = pytest.mark.distributed
STEPS, BATCH, SEQ_LEN, TP = 3, 4, 32, 2
N_LAYER, N_EMBD = 2, 64  # the tiny preset
DTENSOR_RUNS = tuple((name, options) for name, options in DEFAULT_RUNS if options["implementation"] == "dtensor")


@pytest.fixture(scope="module")
def reference():
    return reference_run(steps=STEPS, batch=BATCH, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(tp_checks, TP, kwargs=dict(runs=DTENSOR_RUNS, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN),
                  log_dir=tmp_path_factory.mktemp("dtensor_logs"), echo=False, timeout_s=120)


@pytest.mark.parametrize("run", [name for name, _ in DTENSOR_RUNS])
def test_dtensor_equals_one_process(reference, ranks, run):
    for rank_results in ranks:
        result = rank_results[run]
        where = f"{run}, rank {result['rank']}"
        assert result["q_proj_placements"] == "(Shard(dim=0),)"
        assert result["q_proj_local_shape"] == (N_EMBD // TP, N_EMBD)
        compare_with_reference(result, reference, where)  # logits, loss, gradients, parameters after STEPS steps
        torch.testing.assert_close(result["losses"], reference["losses"], msg=f"{where}: losses")


def test_collectives_per_plan(ranks):
    tokens = BATCH * SEQ_LEN * N_EMBD * 4  # bytes of one (b, s, h) fp32 activation
    for rank_results in ranks:
        fused = rank_results["dtensor"]["collectives"]
        assert fused == {"forward all_reduce": {"calls": 2 * N_LAYER, "bytes": 2 * N_LAYER * tokens},
                         "backward all_reduce": {"calls": 2 * N_LAYER, "bytes": 2 * N_LAYER * tokens}}
        # Without a DTensor region input, each of q, k, v, gate, up all-reduces its own input gradient.
        per_projection = rank_results["dtensor, f per projection"]["collectives"]
        assert per_projection["backward all_reduce"]["calls"] == 5 * N_LAYER
        assert per_projection["forward all_reduce"] == fused["forward all_reduce"]
        # Sequence parallelism: each all-reduce becomes a reduce-scatter (+ an all-gather before the next
        # region); one more all-gather feeds the replicated lm_head.
        sp = rank_results["dtensor + sequence parallel"]["collectives"]
        assert "forward all_reduce" not in sp and "backward all_reduce" not in sp
        assert sp["forward reduce_scatter_tensor"] == {"calls": 2 * N_LAYER, "bytes": 2 * N_LAYER * tokens}
        assert sp["forward all_gather_into_tensor"] == {"calls": 2 * N_LAYER + 1,
                                                         "bytes": (2 * N_LAYER + 1) * tokens // TP}

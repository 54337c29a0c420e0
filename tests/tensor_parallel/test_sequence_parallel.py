"""Sequence parallelism (course_lib/tensor_parallel/sequence_parallel.py) and the worker that grades F/01b's
exercise: a tensor-parallel block whose norms run on this rank's positions equals the whole block, sends the
elements of tensor parallelism's all-reduces, and saves 1/t of what its norms save in one process.

    .venv/bin/python -m pytest -q tests/tensor_parallel/test_sequence_parallel.py
"""

import pytest
import torch
import torch.nn as nn

from course_lib.runtime.launch import launch
from course_lib.tensor_parallel import (TP_LINEARS, RowParallelLinear, check_sequence_parallel_block,
                                        sequence_parallel_reference)

pytestmark = pytest.mark.distributed


def course_regions():
    from course_lib.tensor_parallel import (gather_from_sequence_parallel_region,
                                            reduce_scatter_to_sequence_parallel_region)

    return gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region


def tensor_parallel_regions():
    """Plain tensor parallelism's f and g: the norms then see the whole sequence, which the block refuses."""
    from course_lib.tensor_parallel import copy_to_parallel_region, reduce_from_parallel_region

    return copy_to_parallel_region, reduce_from_parallel_region


@pytest.fixture(autouse=True)
def forked(monkeypatch):  # the functions above are this file's: forked ranks have them
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "fork")


@pytest.mark.parametrize("t", [2, 4])
def test_the_sequence_parallel_block_equals_one_process(tmp_path, t):
    ranks = launch(check_sequence_parallel_block, t, args=(course_regions,), log_dir=tmp_path, timeout_s=60,
                   echo=False)
    reference = sequence_parallel_reference()
    for r in ranks:
        rows = slice(*r["positions"])
        torch.testing.assert_close(r["y"], reference["y"][:, rows])
        torch.testing.assert_close(r["x_grad"], reference["x_grad"][:, rows])
        for name, full in reference["grads"].items():
            layer = name.rsplit(".", 1)[0]
            if layer in TP_LINEARS:
                size = full.shape[0 if TP_LINEARS[layer] == "column" else 1] // t
                part = slice(r["rank"] * size, (r["rank"] + 1) * size)
                full = full[part] if TP_LINEARS[layer] == "column" else full[:, part]
            torch.testing.assert_close(r["grads"][name], full)
        for phase in ("forward", "backward"):
            names = sorted(c["name"] for c in r["calls"] if c["phase"] == phase)
            assert names == ["all_gather_single"] * 2 + ["reduce_scatter_single"] * 2
            assert {c["numel"] for c in r["calls"]} == {r["bsh"]}
        for name, whole in reference["norm_saved_bytes"].items():
            assert r["norm_saved_bytes"][name] * t == whole > 0
            assert r["norm_saved_bytes"][name] == r["norm_formula_bytes"][name]  # memory.activations.layer_terms
            assert reference["norm_formula_bytes"][name] == whole


def test_tensor_parallel_regions_are_not_sequence_parallel(tmp_path):
    from course_lib.runtime.launch import RankFailure

    with pytest.raises(RankFailure):
        launch(check_sequence_parallel_block, 2, args=(tensor_parallel_regions,), log_dir=tmp_path, timeout_s=60,
               echo=False)


def test_a_row_parallel_layer_without_its_reduction_refuses_a_bias():
    import torch.distributed as dist

    from course_lib.runtime.spawn import single_process_group

    with single_process_group():
        with pytest.raises(ValueError, match="add the bias after the reduction"):
            RowParallelLinear(nn.Linear(4, 4, bias=True), reduce=False)
        assert dist.is_initialized()

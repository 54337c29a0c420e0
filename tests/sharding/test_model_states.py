"""The model-state bytes each rank holds, counted from its live tensors, equal the ZeRO formulas to the byte.

    .venv/bin/python -m pytest -q tests/sharding/test_model_states.py

Measured right after the optimizer step, for torch DDP + torch AdamW (stage 0, with its step counters) and
for course_lib.sharding.zero stages 0-3, fp32 (K = 8) and mixed precision (bf16 + fp32 master, K = 12), at world
sizes 1, 2 and 4. The model has 102,762 parameters, not a multiple of 4: at world size 4 the padded flat
vector has 2 extra elements, and every sharded term counts them.
"""

import pytest
import torch

from course_lib.memory.formulas import zero_memory_per_gpu
from course_lib.data_parallel.collectives import shard_numel
from course_lib.runtime.launch import launch
from course_lib.runtime.spawn import single_process_group
from course_lib.sharding.model_states import KINDS, expected_model_states, live_bytes, local_tensor, measure_model_states
from course_lib.sharding.zero_workers import make_model, zero_parity_run

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "mixed")


def test_live_bytes_counts_each_storage_once():
    buffer = torch.zeros(10)
    assert live_bytes([buffer[:5], buffer[5:], buffer]) == 10 * 4  # three views, one storage
    assert live_bytes([torch.zeros(6)[:5]]) == 6 * 4  # a shard narrowed out of a padded buffer: padding counts
    assert live_bytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)]) == 3 * 2 + 3 * 4
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)  # how ZeRO-3 frees a unit's full parameters
    assert live_bytes([freed]) == 0
    seen = set()
    assert live_bytes([buffer], seen) == 40 and live_bytes([buffer[2:]], seen) == 0  # `seen` spans calls


def test_local_tensor_of_a_dtensor_is_its_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = torch.ones(3)
    assert local_tensor(plain) is plain
    with single_process_group():
        dtensor = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert type(local_tensor(dtensor)) is torch.Tensor and local_tensor(dtensor).shape == (4, 2)


def test_expected_equals_the_paper_formula_when_nothing_is_padded():
    n_params, world_size = 7_500_000_000, 64  # the ZeRO paper's Figure 1 example: 120, 31.4, 16.6, 1.88 GB
    for stage in STAGES:
        expected = expected_model_states(n_params, world_size, stage, precision="mixed")
        paper = zero_memory_per_gpu(n_params, world_size, stage)  # 2 + 2 + K, K = 12
        assert [expected[kind] for kind in KINDS] == [getattr(paper, kind) for kind in KINDS]
        assert expected["total"] == paper.total


def test_expected_pads_only_the_sharded_terms():
    n_params, world_size = 10, 4  # S = 3: the padded vector has 12 elements
    padded = shard_numel(n_params, world_size) * world_size
    for stage in STAGES:
        for precision in PRECISIONS:
            odd = expected_model_states(n_params, world_size, stage, precision=precision)
            even = expected_model_states(padded, world_size, stage, precision=precision)
            whole = expected_model_states(n_params, 1, stage, precision=precision)
            for kind, first_sharded_stage in (("optimizer_states", 1), ("grads", 2), ("params", 3)):
                reference = even if stage >= first_sharded_stage else whole
                assert odd[kind] == reference[kind], (stage, precision, kind)
    assert expected_model_states(10, 4, 0, n_step_counters=3)["optimizer_states"] == 10 * 8 + 3 * 4


def test_bad_input_gets_a_clear_error():
    for kwargs, match in ((dict(n_params=0, world_size=2, stage=1), "n_params"),
                          (dict(n_params=10, world_size=2.0, stage=1), "world_size"),
                          (dict(n_params=10, world_size=2, stage=4), "stage"),
                          (dict(n_params=10, world_size=2, stage=1, precision="fp8"), "precision"),
                          (dict(n_params=10, world_size=2, stage=1, optimizer="lion"), "optimizer"),
                          (dict(n_params=10, world_size=2, stage=1, n_step_counters=-1), "n_step_counters")):
        with pytest.raises(ValueError, match=match):
            expected_model_states(**kwargs)
    with pytest.raises(ValueError, match="unknown kind"):
        measure_model_states(torch.nn.Linear(2, 2), extra={"activations": []})


def check_ranks(ranks: list[dict]) -> None:
    n_params = sum(p.numel() for p in make_model().parameters())
    assert n_params % 4 != 0, "the test model must have a parameter count that 4 does not divide"
    for result in ranks:
        world_size, where = result["world_size"], f"rank {result['rank']} of {result['world_size']}"
        ddp = result["ddp"]
        assert ddp["step_counters"] == len(list(make_model().parameters()))  # torch AdamW: one per tensor
        assert ddp["memory"] == expected_model_states(n_params, world_size, 0,
                                                      n_step_counters=ddp["step_counters"]), f"DDP, {where}"
        for stage in STAGES:
            for precision in PRECISIONS:
                zero = result[(stage, precision)]
                assert zero["n_params"] == n_params
                expected = expected_model_states(n_params, world_size, stage, precision=precision)
                assert zero["memory"] == expected, f"ZeRO-{stage} {precision}, {where}"
            # bf16 compute with fp32 master weights trains like fp32 (loosely: bf16 has 8 bits of mantissa)
            torch.testing.assert_close(result[(stage, "mixed")]["losses"], result[(stage, "fp32")]["losses"],
                                       rtol=1e-2, atol=1e-2)
    if ranks[0]["world_size"] == 4:  # the padding shows: 2 extra elements in every sharded term
        padding = 4 * shard_numel(n_params, 4) - n_params
        unpadded = zero_memory_per_gpu(n_params, 4, 3, k=8, param_bytes=4, grad_bytes=4).total  # 16 Psi / 4
        assert padding > 0 and ranks[0][(3, "fp32")]["memory"]["total"] - unpadded == 16 * padding / 4


def test_measured_equals_formula_on_one_rank():
    with single_process_group():
        check_ranks([zero_parity_run(STAGES, PRECISIONS, steps=1)])


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_measured_equals_formula_on_every_rank(tmp_path, world_size):
    ranks = launch(zero_parity_run, world_size, kwargs=dict(stages=STAGES, precisions=PRECISIONS, steps=1),
                   log_dir=tmp_path, echo=False, threads_per_rank=1)
    check_ranks(ranks)

"""course_lib.data_parallel.collective_gate: collectives recorded and refused where every road meets (the dispatcher's
c10d operators, and the Backend methods), whatever name reached them. The ring exercise's check uses it
(tests/data_parallel/test_sync_exercise_workers.py runs the roads on two ranks).

    .venv/bin/python -m pytest -q tests/data_parallel/test_collective_gate.py
"""

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import distributed_c10d

from course_lib.data_parallel.collective_gate import CollectiveRefused, kind_of, process_group_calls
from course_lib.runtime.spawn import single_process_group


def test_operator_and_method_names_map_to_kinds():
    assert {name: kind_of(name) for name in (
        "c10d.allreduce_", "c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_",
        "c10d.reduce_scatter_tensor_coalesced_", "_c10d_functional.all_gather_into_tensor",
        "_c10d_functional.all_to_all_single", "c10d.send", "c10d.recv_any_source_", "Backend.recv_anysource",
        "c10d.barrier", "_c10d_functional.wait_tensor", "aten.add")} == {
        "c10d.allreduce_": "allreduce", "c10d._allgather_base_": "allgather",
        "c10d.allgather_into_tensor_coalesced_": "allgather", "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "_c10d_functional.all_gather_into_tensor": "allgather", "_c10d_functional.all_to_all_single": "alltoall",
        "c10d.send": "send", "c10d.recv_any_source_": "recv", "Backend.recv_anysource": "recv", "c10d.barrier": "barrier",
        "_c10d_functional.wait_tensor": None, "aten.add": None}


def test_every_road_to_a_collective_is_recorded_and_the_backend_is_put_back():
    before = dict(vars(c10d.Backend))
    with single_process_group():
        group = distributed_c10d._get_default_group()
        with process_group_calls() as calls:
            dist.all_reduce(torch.ones(3))
            distributed_c10d.all_reduce(torch.ones(4))
            group.allreduce([torch.ones(5)]).wait()
            group._get_backend(torch.device("cpu")).allreduce([torch.ones(6)]).wait()
            import torch.distributed._functional_collectives as funcol
            funcol.wait_tensor(funcol.all_reduce(torch.ones(7), "sum", dist.group.WORLD))
            dist.all_gather_single(torch.empty(8), torch.ones(8))
        assert [(call.kind, call.elements) for call in calls] == [
            ("allreduce", 3), ("allreduce", 4), ("allreduce", 5), ("allreduce", 6), ("allreduce", 7),
            ("allgather", 16)]
        dist.all_reduce(torch.ones(1))  # after the block: neither recorded nor refused
    assert len(calls) == 6
    assert dict(vars(c10d.Backend)) == before


def test_refused_kinds_raise_before_running():
    with single_process_group():
        tensor = torch.ones(2)
        with process_group_calls(refused=("allreduce",), reason="write the sum yourself") as calls:
            with pytest.raises(CollectiveRefused, match=r"write the sum yourself \(allreduce reached through c10d"):
                distributed_c10d.all_reduce(tensor)
            with pytest.raises(CollectiveRefused, match="Backend.allreduce"):
                distributed_c10d._get_default_group()._get_backend(tensor.device).allreduce([tensor])
            dist.broadcast(tensor, src=0)  # not refused
        assert [call.kind for call in calls] == ["broadcast"]
        torch.testing.assert_close(tensor, torch.ones(2))

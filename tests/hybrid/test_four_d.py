"""Four dimensions on eight ranks (course_lib/hybrid/four_d.py): data x context x tensor parallelism with the experts
spread over the data and context ranks, in a mixture-of-experts block, equal to one process.

    .venv/bin/python -m pytest -q tests/hybrid/test_four_d.py
"""

import pytest
import torch

from course_lib.hybrid import four_d_groups, four_d_place, four_d_reference, four_d_run
from course_lib.runtime.launch import launch

pytestmark = pytest.mark.distributed


def test_every_rank_is_in_one_group_of_each_kind_and_the_groups_vary_one_dimension():
    sizes = {"dp": 2, "cp": 2, "tp": 2}
    groups = four_d_groups(sizes)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for kind, members in groups.items():
        assert sorted(r for group in members for r in group) == list(range(8)), kind
    assert four_d_place(6, sizes) == {"dp": 1, "cp": 1, "tp": 0}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_four_dimensions_on_eight_ranks_equal_one_process(tmp_path, layout):
    ranks = launch(four_d_run, 8, kwargs=dict(layout=layout), log_dir=tmp_path, timeout_s=120, echo=False)
    reference = four_d_reference(layout=layout)
    experts = set()
    for r in ranks:
        rows, pos = torch.tensor(r["rows"]), torch.tensor(r["positions"])
        torch.testing.assert_close(r["y"], reference["y"][rows][:, pos])
        torch.testing.assert_close(r["x_grad"], reference["x_grad"][rows][:, pos])
        t = r["place"]["tp"]
        for name, grad in r["grads"].items():
            full = reference["grads"][name]
            if name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                full = full.chunk(2, dim=0)[t]
            elif name.split(".")[1] == "o_proj":
                full = full.chunk(2, dim=1)[t]
            torch.testing.assert_close(grad, full, msg=f"rank {r['rank']}: {name}")
        assert {n.split(".")[2] for n in r["grads"] if n.startswith("moe.experts.")} == set(map(str, r["experts"]))
        experts |= set(r["experts"])
        assert all(value > 0 for value in r["bytes"].values())
    assert experts == {0, 1, 2, 3}
    assert {r["aux"] for r in ranks} != set() and abs(sum(r["aux"] for r in ranks) / 8 - reference["aux"]) < 1e-6

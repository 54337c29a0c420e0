"""The ring-attention exercise's worker (course_lib/context_parallel/exercise_workers.py) measures what an answer
does on real ranks: its output and gradients, its messages, its collectives and its forward flops (F/01b's tests
run through it).

    .venv/bin/python -m pytest -q tests/context_parallel/test_exercise_workers.py
"""

import pytest
import torch
import torch.distributed as dist

from course_lib.context_parallel import check_ring_attention, full_attention_reference, unsplit_sequence
from course_lib.runtime.launch import RankFailure, launch

pytestmark = pytest.mark.distributed


def library_ring(q, k, v, positions_of, merge):
    from course_lib.context_parallel import ring_attention

    layout = "contiguous" if int(positions_of(1)[0]) == q.shape[-2] else "zigzag"
    return ring_attention(q, k, v, layout=layout)


def gathered(q, k, v, positions_of, merge):
    """Every key gathered to every rank: right forward values, but a collective, no ring and no gradient home."""
    size = dist.get_world_size()
    keys, values = [torch.empty_like(k) for _ in range(size)], [torch.empty_like(v) for _ in range(size)]
    dist.all_gather(keys, k.detach())
    dist.all_gather(values, v.detach())
    k_all, v_all = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
    k_pos = torch.cat([positions_of(r) for r in range(size)])
    allowed = positions_of(dist.get_rank())[:, None] >= k_pos[None, :]
    scores = (q @ k_all.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_all


def wrong_shape(q, k, v, positions_of, merge):
    return q.sum()


@pytest.fixture(autouse=True)
def forked(monkeypatch):  # the answers above are this file's functions: forked ranks have them
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "fork")


@pytest.mark.parametrize(("size", "layout"), [(2, "zigzag"), (4, "contiguous")])
def test_the_library_passes_and_its_messages_and_flops_are_measured(tmp_path, size, layout):
    ranks = launch(check_ring_attention, size, args=(library_ring,), kwargs=dict(layout=layout), log_dir=tmp_path,
                   timeout_s=60, echo=False)
    reference = full_attention_reference(seq_len=8 * size)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(unsplit_sequence([r[name] for r in ranks], layout), reference[name])
    for r in ranks:
        assert sum(n for _, _, n in r["sent_forward"]) == (size - 1) * r["kv_bytes"]
        assert r["collectives"] == [] and r["sent_backward"]
    flops = [r["forward_flops"] for r in ranks]
    if layout == "zigzag":
        assert len(set(flops)) == 1, flops
    else:
        assert flops == [flops[0] * (r + 1) for r in range(size)], flops


def test_collectives_and_missing_messages_are_seen(tmp_path):
    ranks = launch(check_ring_attention, 2, args=(gathered,), log_dir=tmp_path, timeout_s=60, echo=False)
    reference = full_attention_reference(seq_len=16)
    torch.testing.assert_close(unsplit_sequence([r["out"] for r in ranks]), reference["out"])
    assert all(r["collectives"] == ["all_gather", "all_gather"] and r["sent_forward"] == [] for r in ranks)
    assert all(r["dk"] is None and r["dv"] is None for r in ranks)  # gathered copies carry no gradient home


def test_a_wrong_return_is_named(tmp_path):
    with pytest.raises(RankFailure, match="ring_attention must return this rank's output, a tensor of q's shape"):
        launch(check_ring_attention, 2, args=(wrong_shape,), log_dir=tmp_path, timeout_s=60, echo=False)

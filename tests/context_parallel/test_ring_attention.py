"""Ring attention (course_lib.context_parallel) equals full causal attention in one process.

    .venv/bin/python -m pytest -q tests/context_parallel/test_ring_attention.py

One process checks the pieces (the online-softmax merge, the zigzag split); 2- and 4-rank jobs check forward and
backward against torch's scaled_dot_product_attention in fp32 and bf16, what each rank sends ((N - 1)/N of the
keys and values in forward) and that zigzag gives every rank the same number of query-key pairs.
"""

import pytest
import torch

from course_lib.context_parallel import (full_attention_reference, merge, positions, ring_attention_run,
                                         split_sequence, unsplit_sequence, zigzag_split)
from course_lib.runtime.launch import launch

TOLERANCE = {torch.float32: {}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def test_merge_is_attention_over_the_union_of_the_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 5)
    scores = q @ k.T
    whole = torch.softmax(scores, -1) @ v
    parts = [(torch.softmax(scores[:, s], -1) @ v[s], torch.logsumexp(scores[:, s], -1)) for s in (slice(0, 2), slice(2, 6))]
    out, lse = merge(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    empty = (torch.zeros(3, 5), torch.full((3,), float("-inf")))  # nothing seen yet merges as the identity
    torch.testing.assert_close(merge(*empty, *parts[0])[0], parts[0][0])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_split_and_unsplit_are_inverse_and_positions_match(layout):
    x = torch.arange(16.0).view(1, 16, 1)
    pieces = [split_sequence(x, r, 4, layout) for r in range(4)]
    torch.testing.assert_close(unsplit_sequence(pieces, layout), x)
    for r, piece in enumerate(pieces):
        assert piece.flatten().long().tolist() == positions(r, 4, 4, layout).tolist()
    assert zigzag_split(x, 0, 4).flatten().tolist() == [0, 1, 14, 15]
    with pytest.raises(ValueError, match="2N = 8 equal chunks"):
        zigzag_split(torch.zeros(1, 12, 1), 0, 4)


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "layout", "dtype"), [
    (2, "contiguous", torch.float32), (4, "contiguous", torch.float32), (4, "zigzag", torch.float32),
    (2, "zigzag", torch.bfloat16)])
def test_ring_attention_equals_full_attention(tmp_path, world_size, layout, dtype):
    ranks = launch(ring_attention_run, world_size, kwargs={"layout": layout, "dtype": dtype}, log_dir=tmp_path,
                   echo=False, timeout_s=120, threads_per_rank=1)
    reference = full_attention_reference(dtype=dtype)
    for name in ("out", "dq", "dk", "dv"):
        got = unsplit_sequence([r[name].float() for r in ranks], layout)
        torch.testing.assert_close(got, reference[name], **TOLERANCE[dtype],
                                   msg=lambda m: f"{world_size} ranks, {layout}, {dtype}: {name}\n{m}")
    for r in ranks:  # forward sends its block of K and V on N - 1 times: (N - 1)/N of the whole K and V
        assert r["sent_elements"]["forward"] == (world_size - 1) * r["kv_elements"]
    pairs = [r["pairs"]["forward"] for r in ranks]
    seq_len = 32
    assert sum(pairs) == seq_len * (seq_len + 1) // 2  # every causal (query, key) pair once, over the ranks
    if layout == "zigzag":
        assert len(set(pairs)) == 1, f"zigzag gives every rank the same work: {pairs}"
    else:
        assert pairs == sorted(pairs) and pairs[0] < pairs[-1], f"a contiguous split loads the last rank most: {pairs}"

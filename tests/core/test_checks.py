"""core.checks: one message for a bad count, naming the argument."""

import pytest

from course_lib.core.checks import positive_int, positive_ints


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "4", None])
def test_positive_int_refuses_what_is_not_a_count(value):
    with pytest.raises(ValueError, match=rf"^micro_batches must be a positive integer, got {value!r}$"):
        positive_int("micro_batches", value)


def test_positive_int_returns_the_count_and_positive_ints_names_the_first_bad_one():
    assert positive_int("world_size", 8) == 8
    positive_ints(batch=2, seq_len=16)
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        positive_ints(batch=2, seq_len=0, tp=-1)

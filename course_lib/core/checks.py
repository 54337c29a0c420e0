"""Checks of arguments that every module needs, so that a bad value is named the same way everywhere."""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """`value` if it is an int of at least 1 (a bool is not), else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def positive_ints(**values) -> None:
    """positive_int for each keyword: positive_ints(batch=batch, seq_len=seq_len)."""
    for name, value in values.items():
        positive_int(name, value)

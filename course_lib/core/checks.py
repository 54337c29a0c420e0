"""Checks of arguments that every module needs, so that a bad value is named the same way everywhere."""

from __future__ import annotations

import math


def positive_int(name: str, value) -> int:
    """`value` if it is an int of at least 1 (a bool is not), else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def positive_number(name: str, value, *, whole: bool = False) -> float:
    """`value` if it is a finite number > 0 (a bool is not; whole=True: also a whole number, 64.0 allowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if whole and int(value) != value:
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return value


def one_of(name: str, value, allowed):
    """`value` if it is one of `allowed`, else ValueError listing them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def positive_ints(**values) -> None:
    """positive_int for each keyword: positive_ints(batch=batch, seq_len=seq_len)."""
    for name, value in values.items():
        positive_int(name, value)

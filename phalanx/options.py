"""Checking the numbers users pass (timeouts, counts) before anything is sent (pure)."""

from __future__ import annotations

import math
from typing import Any, overload


@overload
def check_seconds(value: None, name: str = ..., *, allow_zero: bool = ...) -> None: ...


@overload
def check_seconds(value: float, name: str = ..., *, allow_zero: bool = ...) -> float: ...


@overload
def check_seconds(value: Any, name: str = ..., *, allow_zero: bool = ...) -> float | None: ...


def check_seconds(value: Any, name: str = "timeout", *, allow_zero: bool = True) -> float | None:
    """``value`` as seconds: None (no limit) or a non-negative (or positive) number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    return float(value)


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an integer of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value

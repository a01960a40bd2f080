"""coin: a tiny library for legorl's flaky-test example (examples/flaky-task/README.md)."""

from __future__ import annotations

import os


def clamp(value: float, low: float, high: float) -> float:
    """``value`` limited to ``[low, high]``."""
    return max(low, min(value, high))


def mean(values: list[float]) -> float:
    """The arithmetic mean of ``values`` (at least one)."""
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def flip() -> bool:
    """Heads (True) or tails, at random (``os.urandom``)."""
    return os.urandom(1)[0] < 128

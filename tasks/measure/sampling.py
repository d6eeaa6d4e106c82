"""Small pure helpers the measurements share (tasks/measure/benchmark.py, speculation.py): prompts of a given
length, and the median's distribution-free interval."""

from __future__ import annotations


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval for the median from order statistics: the narrowest symmetric pair
    (x_(k), x_(n-k+1)) whose binomial coverage reaches `confidence`, else min–max; returns (low, high, coverage)."""
    from math import comb

    ordered, n = sorted(values), len(values)
    best = (ordered[0], ordered[-1], 1 - 2 * 0.5**n)
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n
        if coverage < confidence:
            break
        best = (ordered[k - 1], ordered[n - k], coverage)
    return best


def repeat_to_length(ids: list[int], length: int) -> list[int]:
    return (ids * (length // len(ids) + 1))[:length]

"""Objectives and the Pareto frontier: which variants are worth considering, and which one a scenario wants.

The scenarios of the field's case studies: `latency` (one user: batch-1 decode speed), `throughput` (a busy
server: aggregate decode speed at the largest measured batch), `memory` (a small machine: peak resident memory,
then size on disk), `serving` (a server under load: served capacity through the real scheduler at the most
clients measured, goodput under the SLO where one is set, else tok/s). A variant is on the frontier when no other variant is at least as good on accuracy
(perplexity ratio), on the objective's speed and on peak memory, and better on one of them.
"""

from __future__ import annotations

from typing import Literal

Objective = Literal["latency", "throughput", "memory", "serving"]

# (perplexity ratio, speed, peak RSS MB): lower, higher, lower is better
Point = tuple[float, float, float]


def dominates(a: Point, b: Point) -> bool:
    """`a` is no worse than `b` on every axis and better on at least one."""
    no_worse = a[0] <= b[0] and a[1] >= b[1] and a[2] <= b[2]
    return no_worse and (a[0] < b[0] or a[1] > b[1] or a[2] < b[2])


def pareto_frontier(points: dict[str, Point]) -> list[str]:
    """Names of the points no other point dominates, in the order given."""
    return [
        name
        for name, point in points.items()
        if not any(dominates(other, point) for key, other in points.items() if key != name)
    ]

"""Served capacity at each window length (`benchmark.served_lengths`): bursts of 1, 2, 4 … clients sending prompts
that fill a window of that length, through the real scheduler in the benchmark's process (`replay`), until a burst
misses the SLO; the metrics and the leaderboard cell read from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.measure.served import LevelResult, ServedPlan, replay, summarize


@dataclass(frozen=True)
class LengthCapacity:
    """Served capacity at one window length (`benchmark.served_lengths`): bursts of 1, 2, 4 … clients sending
    prompts of that length at once, each burst on a fresh scheduler, until one misses the SLO."""

    length: int
    clients: int  # the largest burst whose every p95 met the SLO (0: not even one request alone)
    levels: tuple[LevelResult, ...]  # each burst measured, ascending (empty: a shorter length missed alone)
    peak_rss_mb: tuple[float, ...]  # the measuring process's peak resident memory during each burst


def capacity_by_length(
    runtime: Any,
    plan: ServedPlan,
    peak_rss_mb: Any = lambda: float("nan"),
    reset_peak: Any = lambda: None,
    alone_ttft_ms: dict[int, float] | None = None,
) -> list[LengthCapacity]:
    """Each length of the plan, shortest first: a burst of c requests (the length's first c) through a fresh
    scheduler with the serve settings, every request to its budget, for c in `length_clients` ascending; a burst
    that misses the SLO ends the length (a larger one would queue longer), and a length whose smallest burst misses
    ends the sweep (a longer prompt takes longer). So does a length whose time to the first token measured alone
    (`alone_ttft_ms`, the benchmark's speed at length) is over the SLO's already: not served. `reset_peak` before
    each burst, `peak_rss_mb` after it."""
    results, missed_alone, alone = [], False, alone_ttft_ms or {}
    for length, requests in sorted(plan.lengths):
        bound = plan.slo.ttft_p95_ms if plan.slo is not None else None
        missed_alone = missed_alone or (bound is not None and alone.get(length, 0.0) > bound)
        levels, peaks, best = [], [], 0
        for count in [] if missed_alone else plan.length_clients:
            reset_peak()
            outcomes, wall = replay(runtime, requests[:count], count, plan.limits, stop_at_eos=False)
            levels.append(summarize(count, outcomes, wall, slo=plan.slo))
            peaks.append(peak_rss_mb())
            if plan.slo is None or not levels[-1].meets(plan.slo):
                break
            best = count
        missed_alone = missed_alone or best == 0
        results.append(LengthCapacity(length, best, tuple(levels), tuple(peaks)))
    return results


def capacity_metrics(capacities: tuple[LengthCapacity, ...] | list[LengthCapacity]) -> dict[str, float]:
    """`served_clients_ctx<L>` (the largest burst meeting the SLO) and per burst measured `served_ttft_p95_ms_ctx<L>_c<c>`,
    `served_tpot_p95_ms_ctx<L>_c<c>`, `served_tok_s_ctx<L>_c<c>`, `served_peak_rss_mb_ctx<L>_c<c>`."""
    metrics: dict[str, float] = {}
    for capacity in capacities:
        metrics[f"served_clients_ctx{capacity.length}"] = capacity.clients
        for level, peak in zip(capacity.levels, capacity.peak_rss_mb, strict=True):
            key = f"ctx{capacity.length}_c{level.concurrency}"
            values = {
                f"served_ttft_p95_ms_{key}": round(level.ttft_p95_ms, 1),
                f"served_tpot_p95_ms_{key}": round(level.tpot_p95_ms, 2),
                f"served_tok_s_{key}": round(level.tok_s, 2),
                f"served_peak_rss_mb_{key}": round(peak, 1),
            }
            metrics |= {name: value for name, value in values.items() if value == value}
    return metrics


def capacity_from_dict(data: dict) -> LengthCapacity:
    """A `LengthCapacity` back from `dataclasses.asdict` (across the benchmark's process boundary)."""
    levels = tuple(LevelResult(**level) for level in data["levels"])
    return LengthCapacity(data["length"], data["clients"], levels, tuple(data["peak_rss_mb"]))

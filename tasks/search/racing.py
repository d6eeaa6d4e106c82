"""The racing rule of the recipe search: candidates measured round by round against a leader (the best default
variant), each dropped as soon as it is significantly slower than the leader or surely outside the accuracy
budget, the survivors measured in full, the winner confirmed on fresh measurements before the gate.

The error rate is spent across the rounds (Bonferroni over the planned looks): each of the `rounds` looks at a
candidate uses an interval at level 1 - alpha / rounds, so the chance that any of its speed looks misreads it is
at most alpha (as far as the t interval holds) whatever round the race stops at — stopping early costs no
validity, looking more often than `rounds` does (the driver must not). The bound is per candidate: across many
candidates, a false drop of one of them is likelier than alpha (what matters is the winner, confirmed apart). The
accuracy looks' bootstrap at these levels is approximate (few resamples in each tail at 1 - alpha/rounds).
Speed is read as the geometric mean of paired ratios (candidate ÷ leader, back-to-back runs, as
`paired_speed_ratio` pairs them) with a Student t interval on the log ratios, which holds at the few pairs a
round has where a bootstrap's percentiles do not. Accuracy is read as the paired perplexity ratio to the
baseline on the same windows (the bootstrap of tasks/decide/statistics.py, at the look's level).

The winner's curse: the best of many noisy candidates looks better than it is, so the winner's ratio is read
again on benchmark trials and windows it was not selected on (`confirm`, one look at the full alpha) and only that
reading goes to the gate. docs/search.md states the rule with its numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tasks.decide.statistics import paired_bootstrap_ppl_ratio
from tasks.errors import ComparisonError

SpeedDecision = Literal["slower", "faster", "undecided"]
AccuracyDecision = Literal["outside", "within", "undecided"]


@dataclass(frozen=True)
class SpeedLook:
    """A candidate's speed against the leader after some rounds: the geometric-mean ratio candidate ÷ leader
    (higher is faster) over `pairs` paired measurements, its interval at `confidence`, and what it decides."""

    ratio: float
    low: float
    high: float
    pairs: int
    confidence: float

    @property
    def decision(self) -> SpeedDecision:
        if self.high < 1.0:
            return "slower"
        if self.low > 1.0:
            return "faster"
        return "undecided"


@dataclass(frozen=True)
class AccuracyLook:
    """A candidate's perplexity ratio to the baseline on the windows read so far, its interval at `confidence`, and
    where it stands against the budget (the ratio's ceiling, 1 + max_ppl_increase)."""

    ratio: float
    low: float
    high: float
    ceiling: float
    confidence: float

    @property
    def decision(self) -> AccuracyDecision:
        if self.low > self.ceiling:
            return "outside"
        if self.high <= self.ceiling:
            return "within"
        return "undecided"


def look_confidence(alpha: float, rounds: int) -> float:
    """The level of each of `rounds` looks so that all of them together miss with probability alpha at most."""
    if not 0 < alpha < 1 or rounds < 1:
        raise ValueError(f"alpha must be in (0, 1) and rounds at least 1, got {alpha} and {rounds}")
    return 1 - alpha / rounds


def speed_look(candidate: list[float], leader: list[float], confidence: float) -> SpeedLook:
    """Paired speeds (pair i: back-to-back runs of the two, higher is faster) read as a ratio with a Student t
    interval on the log ratios at `confidence`. Fewer than two pairs: an interval that decides nothing."""
    from scipy import stats

    if len(candidate) != len(leader) or not candidate:
        raise ComparisonError("cannot pair speeds: the two were not measured the same number of times")
    logs = np.log(np.asarray(candidate, dtype=np.float64)) - np.log(np.asarray(leader, dtype=np.float64))
    mean, pairs = float(logs.mean()), len(logs)
    if pairs < 2:
        return SpeedLook(math.exp(mean), 0.0, math.inf, pairs, confidence)
    spread = float(logs.std(ddof=1)) / math.sqrt(pairs)
    half = float(stats.t.ppf(1 - (1 - confidence) / 2, pairs - 1)) * spread
    return SpeedLook(math.exp(mean), math.exp(mean - half), math.exp(mean + half), pairs, confidence)


def accuracy_look(
    base_nll: list[float],
    candidate_nll: list[float],
    tokens: list[int],
    max_ppl_increase: float,
    confidence: float,
    seed: int = 0,
    resamples: int = 2000,
) -> AccuracyLook:
    """The candidate's perplexity ratio to the baseline on the same windows (summed NLL per window, `tokens`
    scored in each), with the paired bootstrap's interval at `confidence`, against 1 + `max_ppl_increase`."""
    interval = paired_bootstrap_ppl_ratio(
        base_nll, tokens, candidate_nll, tokens, resamples, confidence, seed
    )
    return AccuracyLook(interval.ratio, interval.low, interval.high, 1 + max_ppl_increase, confidence)


@dataclass(frozen=True)
class Standing:
    """Where a raced candidate stands after a round: still racing, or dropped and why (in words)."""

    name: str
    speed: SpeedLook | None
    accuracy: AccuracyLook | None
    dropped: str | None = None


def judge_round(name: str, speed: SpeedLook | None, accuracy: AccuracyLook | None) -> Standing:
    """A candidate's standing after a round's looks: dropped when surely outside the accuracy budget (before any
    more of its benchmark is spent) or significantly slower than the leader; racing otherwise."""
    dropped = None
    if accuracy is not None and accuracy.decision == "outside":
        dropped = (
            f"outside the accuracy budget: perplexity ×{accuracy.ratio:.3f} "
            f"({accuracy.low:.3f}–{accuracy.high:.3f} at {accuracy.confidence:.1%}) > ×{accuracy.ceiling:.3f}"
        )
    elif speed is not None and speed.decision == "slower":
        dropped = (
            f"slower than the leader: ×{speed.ratio:.3f} ({speed.low:.3f}–{speed.high:.3f} at "
            f"{speed.confidence:.1%})"
        )
    return Standing(name, speed, accuracy, dropped)


def confirm(candidate: list[float], leader: list[float], alpha: float) -> SpeedLook:
    """The winner's speed ratio to the leader read once more, on fresh pairs it was not selected on, at the full
    1 - alpha: what the gate is shown (a win only where its low bound is above 1)."""
    return speed_look(candidate, leader, 1 - alpha)

"""The recipe search's course, from candidates to a confirmed winner or none: proxies and the screen, rounds of the
race against the leader, then the winner's confirmation on measurements it was not selected on.

It decides and counts; what it measures comes from a `Measurer` (builds, engines, benchmark runs and evaluation
windows in the real search; planted figures in the tests), so the same course is tested by simulation:

1. every candidate's proxies (`proxies.screen`: far outside the accuracy budget, beaten on all three proxies, or
   not among the `keep` fastest: not raced);
2. `rounds` rounds: each reads the candidate's perplexity on `windows_per_round` more windows of the search split
   first (surely outside the budget: dropped before another benchmark run is spent on it), then adds
   `pairs_per_round` back-to-back speed pairs against the leader (significantly slower: dropped). Each look is at
   1 - alpha / rounds (racing.look_confidence);
3. the survivors have been measured in full; the fastest of them that is not outside the budget is confirmed on
   `confirm_pairs` fresh pairs and the held-out split's windows at the full 1 - alpha: a win only where its speed
   ratio's low bound is above 1 and its perplexity ratio's high bound within the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from tasks.search.proxies import Proxy, screen
from tasks.search.racing import (
    AccuracyLook,
    SpeedLook,
    Standing,
    accuracy_look,
    confirm,
    judge_round,
    look_confidence,
    speed_look,
)

Split = Literal["search", "confirm"]


class Measurer(Protocol):
    def proxy(self, name: str) -> Proxy: ...

    def pair(self, name: str, leader: str) -> tuple[float, float]:
        """One back-to-back speed pair (candidate's, leader's), higher is faster."""
        ...

    def window_nll(self, name: str, split: Split, start: int, stop: int) -> list[float]:
        """Summed NLL of each of the split's windows [start, stop)."""
        ...

    def window_tokens(self, split: Split, start: int, stop: int) -> list[int]: ...


@dataclass(frozen=True)
class RacePlan:
    max_ppl_increase: float = 0.05
    alpha: float = 0.05
    rounds: int = 4
    pairs_per_round: int = 3
    windows_per_round: int = 16
    keep: int = 8  # raced after the screen
    kl_margin: float = 15.0
    confirm_pairs: int = 6
    confirm_windows: int = 32
    baseline: str = "baseline"


@dataclass
class Trial:
    """One candidate's way through the search: the stage it reached and why it stopped there."""

    name: str
    stage: Literal["screened out", "dropped", "measured", "confirmed", "not confirmed"] = "measured"
    reason: str = ""
    proxy: Proxy | None = None
    looks: list[Standing] = field(default_factory=list)
    speeds: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))  # candidate, leader


@dataclass(frozen=True)
class SearchOutcome:
    trials: dict[str, Trial]
    winner: str | None
    confirmation: tuple[SpeedLook, AccuracyLook] | None

    def counts(self) -> dict[str, int]:
        """How many candidates were proposed, proxied, raced, measured in full and confirmed."""
        trials = self.trials.values()
        raced = [t for t in trials if t.stage != "screened out"]
        return {
            "proposed": len(self.trials),
            "proxied": sum(t.proxy is not None for t in trials),
            "raced": len(raced),
            "measured": sum(t.stage in ("measured", "confirmed", "not confirmed") for t in trials),
            "confirmed": sum(t.stage == "confirmed" for t in trials),
        }


def run_search(
    candidates: list[str],
    leader: str,
    measurer: Measurer,
    plan: RacePlan,
    report: Callable[[str], None] = lambda line: None,
) -> SearchOutcome:
    """The whole course for `candidates` against `leader` (the best default variant, never among them); `report`
    gets a line per candidate per round and one for the confirmation (the search's progress)."""
    if leader in candidates:
        raise ValueError(f"the leader {leader!r} is not a candidate of its own race")
    trials = {name: Trial(name) for name in candidates}
    for name in candidates:
        trials[name].proxy = measurer.proxy(name)
    confidence = look_confidence(plan.alpha, plan.rounds)
    alive = _first_looks(trials, measurer, plan, confidence, report)
    for round_ in range(1, plan.rounds + 1):
        if not alive:
            break
        stop = round_ * plan.windows_per_round
        base, tokens = (
            measurer.window_nll(plan.baseline, "search", 0, stop),
            measurer.window_tokens("search", 0, stop),
        )
        for name in list(alive):
            alive = _race_round(trials[name], leader, measurer, plan, confidence, base, tokens, alive)
            look = trials[name].looks[-1]
            state = (
                trials[name].reason if name not in alive else f"×{look.speed.ratio:.3f} the leader, racing on"
            )
            report(f"round {round_}/{plan.rounds}: {name}: {state}")
        if leading := [n for n in alive if trials[n].looks and trials[n].looks[-1].speed]:
            best = max(leading, key=lambda n: trials[n].looks[-1].speed.ratio)
            speed = trials[best].looks[-1].speed
            report(
                f"round {round_}/{plan.rounds}: {len(alive)} racing on; best so far {best}, ×{speed.ratio:.3f} the "
                f"leader ({speed.low:.3f}–{speed.high:.3f})"
            )
    outcome = _confirmed(trials, alive, leader, measurer, plan)
    if outcome.confirmation is not None:
        best = max(outcome.trials.values(), key=lambda t: t.stage in ("confirmed", "not confirmed"))
        report(f"confirmation: {best.name} {best.stage}: {best.reason}")
    return outcome


def _first_looks(
    trials: dict[str, Trial],
    measurer: Measurer,
    plan: RacePlan,
    confidence: float,
    report: Callable[[str], None],
) -> list[str]:
    """The screen on the proxies (far outside the budget on KL), then the first round's accuracy look for the rest,
    fastest proxy first, until `keep` are not surely outside the budget: those race. Windows only, no benchmark run:
    what is surely outside is dropped before a speed pair is spent on it, and a slot is not."""
    proxies = [t.proxy for t in trials.values() if t.proxy]
    screened = screen(proxies, len(proxies), plan.max_ppl_increase, plan.kl_margin)
    for name, reason in screened.dropped.items():
        trials[name].stage, trials[name].reason = "screened out", reason
    stop, alive = plan.windows_per_round, []
    base, tokens = (
        measurer.window_nll(plan.baseline, "search", 0, stop),
        measurer.window_tokens("search", 0, stop),
    )
    for name in screened.kept:
        if len(alive) == plan.keep:
            trials[name].stage = "screened out"
            trials[
                name
            ].reason = f"not among the {plan.keep} fastest within the accuracy budget at the first look"
            continue
        nll = measurer.window_nll(name, "search", 0, stop)
        accuracy = accuracy_look(base, nll, tokens, plan.max_ppl_increase, confidence)
        if accuracy.decision == "outside":
            standing = judge_round(name, None, accuracy)
            trials[name].looks.append(standing)
            trials[name].stage, trials[name].reason = "dropped", f"round 1: {standing.dropped}"
        else:
            alive.append(name)
        state = trials[name].reason if name not in alive else f"races ({len(alive)} of {plan.keep})"
        report(f"first look: {name}: perplexity ×{accuracy.ratio:.3f}; {state}")
    return alive


def _race_round(
    trial: Trial,
    leader: str,
    measurer: Measurer,
    plan: RacePlan,
    confidence: float,
    base: list[float],
    tokens: list[int],
    alive: list[str],
) -> list[str]:
    accuracy = accuracy_look(
        base,
        measurer.window_nll(trial.name, "search", 0, len(base)),
        tokens,
        plan.max_ppl_increase,
        confidence,
    )
    speed = None
    if accuracy.decision != "outside":  # no more benchmark runs for what is surely outside the budget
        for _ in range(plan.pairs_per_round):
            mine, theirs = measurer.pair(trial.name, leader)
            trial.speeds[0].append(mine)
            trial.speeds[1].append(theirs)
        speed = speed_look(trial.speeds[0], trial.speeds[1], confidence)
    standing = judge_round(trial.name, speed, accuracy)
    trial.looks.append(standing)
    if standing.dropped:
        trial.stage, trial.reason = "dropped", f"round {len(trial.looks)}: {standing.dropped}"
        return [name for name in alive if name != trial.name]
    return alive


def _confirmed(
    trials: dict[str, Trial], alive: list[str], leader: str, measurer: Measurer, plan: RacePlan
) -> SearchOutcome:
    ranked = sorted(
        (trials[name] for name in alive if trials[name].looks[-1].accuracy.decision != "outside"),
        key=lambda t: -(t.looks[-1].speed.ratio if t.looks[-1].speed else 0.0),
    )
    if not ranked:
        return SearchOutcome(trials, None, None)
    best = ranked[0]
    fresh = [measurer.pair(best.name, leader) for _ in range(plan.confirm_pairs)]
    speed = confirm([mine for mine, _ in fresh], [theirs for _, theirs in fresh], plan.alpha)
    accuracy = accuracy_look(
        measurer.window_nll(plan.baseline, "confirm", 0, plan.confirm_windows),
        measurer.window_nll(best.name, "confirm", 0, plan.confirm_windows),
        measurer.window_tokens("confirm", 0, plan.confirm_windows),
        plan.max_ppl_increase,
        1 - plan.alpha,
    )
    won = speed.low > 1.0 and accuracy.decision == "within"
    best.stage = "confirmed" if won else "not confirmed"
    best.reason = (
        f"×{speed.ratio:.3f} the leader ({speed.low:.3f}–{speed.high:.3f} at {speed.confidence:.1%}) on fresh "
        f"pairs, perplexity ×{accuracy.ratio:.3f} (≤ {accuracy.high:.3f}) on held-out windows"
    )
    return SearchOutcome(trials, best.name if won else None, (speed, accuracy))

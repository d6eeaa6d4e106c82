"""The search's course (tasks/search/driver.py) by simulation: planted speeds with a shared machine-load term per
pair and 5 % noise per run, planted perplexity per window. Equal recipes are not promoted on noise, a recipe
surely outside the accuracy budget gets no benchmark run, a truly faster one is confirmed, and the counts add up."""

from __future__ import annotations

import math

import numpy as np

from tasks.search.driver import RacePlan, run_search
from tasks.search.proxies import Proxy

TOKENS = 256


class Planted:
    """Candidates of planted true speed (tok/s) and perplexity ratio (per window, with noise); every pair and
    window it is asked for is counted."""

    def __init__(
        self,
        speeds: dict[str, float],
        ratios: dict[str, float],
        seed: int,
        kl: dict | None = None,
        sizes=None,
    ):
        self.speeds, self.ratios, self.kl, self.sizes = speeds, ratios, kl or {}, sizes or {}
        self.rng = np.random.default_rng(seed)
        self.pairs: dict[str, int] = {}
        base = np.random.default_rng(1000 + seed)
        self.base_nll = {
            split: 3.5 * TOKENS * (1 + 0.2 * base.random(200)) for split in ("search", "confirm")
        }
        self.noise = {
            split: np.random.default_rng(2000 + seed).normal(0, 0.004, 200) for split in self.base_nll
        }

    def proxy(self, name):
        kl = self.kl.get(name, math.log(self.ratios[name]))  # one noisy short decode for its speed
        speed = self.speeds[name] * math.exp(self.rng.normal(0, 0.05))
        return Proxy(name, self.sizes.get(name, 100), kl, (), speed)

    def pair(self, name, leader):
        self.pairs[name] = self.pairs.get(name, 0) + 1
        load = math.exp(self.rng.normal(0, 0.1))  # the machine's load, shared by the two runs of a pair
        run = lambda speed: speed * load * math.exp(self.rng.normal(0, 0.05))  # noqa: E731
        return run(self.speeds[name]), run(self.speeds[leader])

    def window_nll(self, name, split, start, stop):
        base = self.base_nll[split][start:stop]
        if name == "baseline":
            return list(base)
        shift = math.log(self.ratios[name]) * TOKENS
        return list(base + shift + self.noise[split][start:stop] * TOKENS * (name != "leader"))

    def window_tokens(self, split, start, stop):
        return [TOKENS] * (stop - start)


SPEEDS = {"leader": 100.0}
PLAN = RacePlan(rounds=4, pairs_per_round=3, windows_per_round=16, confirm_pairs=6, confirm_windows=32)


def test_recipes_as_fast_as_the_leader_are_not_promoted_on_noise():
    wins = 0
    for seed in range(150):
        measurer = Planted(
            {**SPEEDS, "a": 100.0, "b": 100.0, "c": 100.0},
            {"a": 1.02, "b": 1.01, "c": 1.0},
            seed,
            sizes={"a": 80, "b": 100, "c": 120},  # a trade-off each: none is screened out by another
        )
        outcome = run_search(["a", "b", "c"], "leader", measurer, PLAN)
        assert outcome.counts()["raced"] == 3
        wins += outcome.winner is not None
    assert wins <= 0.05 * 150  # confirmation on fresh pairs: a false win is one tail of a 95 % interval


def test_a_recipe_surely_outside_the_budget_gets_no_benchmark_run_and_a_faster_one_is_confirmed():
    measurer = Planted(
        {**SPEEDS, "broken": 300.0, "fast": 125.0, "slow": 70.0},
        {"broken": 1.4, "fast": 1.01, "slow": 1.0},
        0,
    )
    outcome = run_search(["broken", "fast", "slow"], "leader", measurer, PLAN)
    trials = outcome.trials
    assert trials["broken"].stage == "dropped" and "outside the accuracy budget" in trials["broken"].reason
    assert "broken" not in measurer.pairs  # dropped at its first look, before any pair
    assert trials["slow"].stage == "dropped" and "slower than the leader" in trials["slow"].reason
    assert outcome.winner == "fast" and trials["fast"].stage == "confirmed"
    speed, accuracy = outcome.confirmation
    assert speed.low > 1.0 and accuracy.decision == "within"
    assert outcome.counts() == {"proposed": 3, "proxied": 3, "raced": 3, "measured": 1, "confirmed": 1}


def test_the_screen_keeps_what_is_far_outside_from_the_race():
    measurer = Planted(
        {**SPEEDS, "wild": 400.0, "fast": 125.0}, {"wild": 2.0, "fast": 1.01}, 1, kl={"wild": 5.0}
    )
    outcome = run_search(["wild", "fast"], "leader", measurer, PLAN)
    assert outcome.trials["wild"].stage == "screened out" and "KL" in outcome.trials["wild"].reason
    assert "wild" not in measurer.pairs
    assert outcome.counts()["raced"] == 1 and outcome.winner == "fast"


def test_the_race_s_slots_go_to_candidates_within_the_budget_however_fast_the_others_are():
    # the default model's first 30-minute search: the 8 fastest were all outside the budget, and the slower
    # recipes within it were left out of a race of 8 slots; each first look is read before a slot is given
    outside = {f"fast{i}": 200.0 + i for i in range(3)}
    within = {"steady": 120.0, "slow": 90.0, "slowest": 80.0}
    ratios = {**dict.fromkeys(outside, 1.2), "steady": 1.01, "slow": 1.0, "slowest": 1.0}
    measurer = Planted({**SPEEDS, **outside, **within}, ratios, 3, kl=dict.fromkeys(ratios, 0.1))
    outcome = run_search([*outside, *within], "leader", measurer, RacePlan(**{**PLAN.__dict__, "keep": 2}))
    trials = outcome.trials
    assert all(trials[name].stage == "dropped" and "outside" in trials[name].reason for name in outside)
    assert not set(outside) & set(measurer.pairs)  # no speed pair spent on them
    assert (
        trials["slowest"].stage == "screened out" and "within the accuracy budget" in trials["slowest"].reason
    )
    assert outcome.winner == "steady" and outcome.counts()["raced"] == 5


def test_the_leader_is_not_its_own_candidate():
    import pytest

    with pytest.raises(ValueError, match="not a candidate of its own race"):
        run_search(["leader"], "leader", Planted(SPEEDS, {}, 0), PLAN)


def test_the_course_reports_each_candidates_looks_and_the_confirmation():
    lines: list[str] = []
    measurer = Planted({**SPEEDS, "fast": 125.0, "slow": 70.0}, {"fast": 1.01, "slow": 1.0}, 3)
    run_search(["fast", "slow"], "leader", measurer, PLAN, lines.append)
    assert lines[0].startswith("first look: fast: perplexity ×") and lines[0].endswith("races (1 of 8)")
    assert lines[2].startswith("round 1/4: fast: ×") and "racing on" in lines[2]
    assert any(line.startswith("round 1/4: 1 racing on; best so far fast, ×") for line in lines)
    assert any(line.startswith("round 1/4: slow: round 1: slower than the leader") for line in lines)
    assert lines[-1].startswith("confirmation: fast confirmed: ×")

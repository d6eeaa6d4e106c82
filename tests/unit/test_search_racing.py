"""The recipe search's racing rule (tasks/search/racing.py): looks that spend the error rate across rounds, so two
recipes of the same true speed are not told apart as a win however long they race; a real difference is found;
a candidate surely outside the accuracy budget is dropped whatever its speed."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.search.racing import (
    accuracy_look,
    confirm,
    judge_round,
    look_confidence,
    speed_look,
)

ALPHA, ROUNDS, PAIRS_PER_ROUND = 0.05, 4, 3


def race(true_ratio: float, noise: float, seed: int) -> str:
    """One simulated race: ROUNDS rounds of PAIRS_PER_ROUND paired runs (a slow spell of the machine hits both of a
    pair, the pair's own noise does not), looked at after each round; the first decision ends it."""
    rng = np.random.default_rng(seed)
    candidate, leader = [], []
    for _ in range(ROUNDS):
        machine = rng.normal(0, 0.2, PAIRS_PER_ROUND)  # shared: the load of the machine at that moment
        leader += list(100 * np.exp(machine + rng.normal(0, noise, PAIRS_PER_ROUND)))
        candidate += list(100 * true_ratio * np.exp(machine + rng.normal(0, noise, PAIRS_PER_ROUND)))
        decision = speed_look(candidate, leader, look_confidence(ALPHA, ROUNDS)).decision
        if decision != "undecided":
            return decision
    return "undecided"


def test_each_look_spends_its_share_of_the_error_rate():
    assert look_confidence(0.05, 4) == pytest.approx(0.9875)
    assert look_confidence(0.05, 1) == pytest.approx(0.95)
    with pytest.raises(ValueError):
        look_confidence(0.05, 0)


def test_two_recipes_of_the_same_true_speed_are_not_told_apart_over_the_rounds():
    """Planted equal cost, 5 % noise per run: over 400 races looked at every round, a win or a drop is declared in
    at most alpha of them (the looks together, not each alone)."""
    decisions = [race(1.0, 0.05, seed) for seed in range(400)]
    wrong = sum(decision != "undecided" for decision in decisions) / len(decisions)
    assert wrong <= ALPHA


def test_looking_every_round_at_each_looks_full_alpha_would_declare_false_wins():
    """The same races read without spending (each look at 95 %) go wrong more often than alpha: the spending is
    what keeps the rule honest (and this test's setting able to tell the two apart)."""
    loose = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        candidate, leader = [], []
        for _ in range(ROUNDS):
            machine = rng.normal(0, 0.2, PAIRS_PER_ROUND)
            leader += list(100 * np.exp(machine + rng.normal(0, 0.05, PAIRS_PER_ROUND)))
            candidate += list(100 * np.exp(machine + rng.normal(0, 0.05, PAIRS_PER_ROUND)))
            if speed_look(candidate, leader, 0.95).decision != "undecided":
                loose += 1
                break
    assert loose / 400 > ALPHA


def test_a_real_difference_is_found_within_the_rounds():
    """A candidate 15 % faster, or 15 % slower, is told apart in most races (the rule is not 'never decide')."""
    faster = [race(1.15, 0.05, seed) for seed in range(200)]
    slower = [race(1 / 1.15, 0.05, seed) for seed in range(200)]
    assert faster.count("faster") / 200 >= 0.9 and "slower" not in faster
    assert slower.count("slower") / 200 >= 0.9 and "faster" not in slower


def test_one_pair_decides_nothing_and_an_unpaired_reading_is_refused():
    assert speed_look([120.0], [100.0], 0.95).decision == "undecided"
    with pytest.raises(Exception, match="same number of times"):
        speed_look([1.0, 2.0], [1.0], 0.95)


def test_the_speed_interval_is_students_t_on_the_log_ratios():
    """Log ratios 0.1, 0.2, 0.3: mean 0.2, standard error 0.1/sqrt(3), t(0.975, 2) = 4.303."""
    look = speed_look([float(np.exp(v)) for v in (0.1, 0.2, 0.3)], [1.0, 1.0, 1.0], 0.95)
    half = 4.302653 * 0.1 / np.sqrt(3)
    assert look.ratio == pytest.approx(np.exp(0.2))
    assert look.low == pytest.approx(np.exp(0.2 - half), rel=1e-5)
    assert look.high == pytest.approx(np.exp(0.2 + half), rel=1e-5)


def test_a_candidate_surely_outside_the_accuracy_budget_is_dropped_whatever_its_speed():
    rng = np.random.default_rng(0)
    tokens = [256] * 32
    base = list(rng.normal(3.9, 0.3, 32) * 256)
    worse = [b + 256 * 0.2 for b in base]  # every window ~+22 % perplexity, the budget 5 %
    accuracy = accuracy_look(base, worse, tokens, 0.05, look_confidence(ALPHA, ROUNDS))
    fast = speed_look([150.0, 152.0, 149.0], [100.0, 101.0, 99.0], look_confidence(ALPHA, ROUNDS))
    assert fast.decision == "faster" and accuracy.decision == "outside"
    standing = judge_round("q2", fast, accuracy)
    assert standing.dropped and "outside the accuracy budget" in standing.dropped


def test_a_candidate_within_the_budget_and_not_slower_races_on():
    tokens = [256] * 32
    base = [1000.0 + index for index in range(32)]
    same = [value + 1.0 for value in base]
    accuracy = accuracy_look(base, same, tokens, 0.05, look_confidence(ALPHA, ROUNDS))
    speed = speed_look([101.0, 99.0, 100.5], [100.0, 100.0, 100.0], look_confidence(ALPHA, ROUNDS))
    assert accuracy.decision == "within" and speed.decision == "undecided"
    assert judge_round("q8", speed, accuracy).dropped is None


def test_the_confirmation_reads_fresh_pairs_at_the_full_alpha():
    look = confirm([110.0, 111.0, 109.0, 110.5], [100.0, 100.0, 100.0, 100.0], 0.05)
    assert look.confidence == pytest.approx(0.95) and look.decision == "faster"

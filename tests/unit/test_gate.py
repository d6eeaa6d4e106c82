"""The champion/challenger gate on synthetic measurements: speed decided by paired intervals, accuracy by paired
tests against the champion (deterministic numbers stand in for timings, which are never asserted on)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.config import SelectConfig
from tasks.decide.gate import Champion, judge, objective_samples
from tasks.decide.select import build_leaderboard
from tasks.measure.benchmark import BatchSpeed, BenchmarkResult
from tests.unit.test_select import score, served


def trials(speeds: list[float], rss: float = 500.0, top_batch: float = 100.0) -> list[BenchmarkResult]:
    """One trial per three measured batch-1 speeds (the benchmark's repeats)."""
    result = []
    for start in range(0, len(speeds), 3):
        runs = speeds[start : start + 3]
        batches = [
            BatchSpeed(1, 10.0, runs[1], 5.0, runs, [10.0] * 3),
            BatchSpeed(8, 20.0, top_batch, 5.0, [top_batch] * 3, [20.0] * 3),
        ]
        result.append(
            BenchmarkResult(
                1.0,
                10.0,
                [10.0] * 3,
                runs[1],
                runs,
                (min(runs), max(runs)),
                0.75,
                batches,
                {},
                {"p95": 1.0},
                [],
                16,
                8,
                1000,
                1000,
                rss,
                100.0,
                1,
            )
        )
    return result


STEADY = [100.0, 101.0, 99.0, 100.0, 102.0, 98.0, 100.5, 99.5, 100.0]  # the champion, nine runs


def board_with(*scores):
    return build_leaderboard([score("baseline", 1.0, 10), *scores], SelectConfig())


def test_a_slower_challenger_is_refused_and_production_stays():
    board = board_with(score("bf16", 1.0, 60))  # the run's winner, but production decodes 100 tok/s
    champion = Champion("1", "production-v1", None, trials(STEADY))
    verdict = judge(board, champion, trials([s * 0.6 for s in STEADY]), SelectConfig())
    assert not verdict.passed and verdict.challenger == "bf16" and verdict.champion_version == "1"
    assert "latency ×0.60 of production v1" in verdict.reason and "needs > 1.05" in verdict.reason
    assert verdict.evidence["speed_ratio_ci"][1] < 1.0


def test_a_faster_equally_accurate_challenger_is_promoted():
    champion_score, challenger_score = score("production-v1", 1.0, 100), score("onnx_int4", 1.0, 150)
    board = board_with(champion_score, challenger_score)
    champion = Champion("1", "production-v1", champion_score, trials(STEADY))
    verdict = judge(board, champion, trials([s * 1.5 for s in STEADY]), SelectConfig())
    assert verdict.passed and "onnx_int4 beats production v1: latency ×1.50" in verdict.reason
    assert verdict.evidence["ppl_ratio_vs_champion"] == pytest.approx(1.0)


def test_a_small_speed_gain_inside_the_noise_is_not_enough():
    noisy = [100.0, 80.0, 120.0, 95.0, 110.0, 90.0, 105.0, 85.0, 115.0]
    board = board_with(score("q", 1.0, 103))
    verdict = judge(
        board, Champion("1", "p", None, trials(STEADY)), trials([s * 1.03 for s in noisy]), SelectConfig()
    )
    assert not verdict.passed and verdict.evidence["speed_ratio_ci"][0] <= 1.05


def test_a_planted_regression_within_budget_but_worse_than_the_champion_is_refused_even_when_fastest():
    """Perplexity +4 % on every window: inside the baseline's 5 % budget, significantly worse than production."""
    champion_score = score("production-v1", 1.0, 100)
    regressed = score("fast_but_worse", 1.04, 300)
    board = board_with(champion_score, regressed)
    assert board.winner == "fast_but_worse" and board.row("fast_but_worse").within_budget
    champion = Champion("1", "production-v1", champion_score, trials(STEADY))
    verdict = judge(board, champion, trials([s * 3 for s in STEADY]), SelectConfig())
    assert not verdict.passed
    assert "perplexity ×1.040 of production" in verdict.reason and "significantly worse" in verdict.reason


def test_a_cloze_regression_against_the_champion_is_refused():
    """Production answers 10 more cloze items than the baseline; the challenger answers like the baseline: no
    worse than the baseline, significantly worse than production (McNemar p = 0.002)."""
    champion_score = score("production-v1", 1.0, 100, cloze=(True,) * 40 + (False,) * 24)
    challenger = score("like_baseline", 1.0, 300)  # the baseline's own CLOZE answers
    board = board_with(champion_score, challenger)
    assert board.winner == "like_baseline" and board.row("like_baseline").within_budget
    champion = Champion("1", "production-v1", champion_score, trials(STEADY))
    verdict = judge(board, champion, trials([s * 3 for s in STEADY]), SelectConfig())
    assert not verdict.passed and "cloze -15.6% vs production (McNemar p 0.002)" in verdict.reason


def test_a_champion_on_another_tokenizer_is_judged_on_speed_and_the_verdict_says_so():
    board = board_with(score("q", 1.0, 300))
    verdict = judge(
        board,
        Champion("4", "production-v4", None, trials(STEADY)),
        trials([s * 3 for s in STEADY]),
        SelectConfig(),
    )
    assert verdict.passed and "champion on another tokenizer: accuracy vs own baseline only" in verdict.reason
    assert verdict.evidence["paired_accuracy"] is False


def test_the_champion_still_winning_moves_nothing():
    board = board_with(score("production-v1", 1.0, 300))
    verdict = judge(
        board, Champion("1", "production-v1", None, trials(STEADY)), trials(STEADY), SelectConfig()
    )
    assert (
        not verdict.passed
        and verdict.reason == "production v1 is still the best latency of this run; nothing to move"
    )
    rebuilt = judge(
        board_with(score("onnx_int8", 1.0, 300)), Champion("1", "onnx_int8", None, []), [], SelectConfig()
    )
    assert "production v1 (the same bytes as this run's onnx_int8) is still the best" in rebuilt.reason


def test_no_qualifying_variant_promotes_nothing_and_the_first_promotion_needs_no_champion():
    refused = judge(
        build_leaderboard([score("baseline", 1.0, 10)], SelectConfig(min_speedup=2.0)),
        None,
        [],
        SelectConfig(),
    )
    assert not refused.passed and refused.reason.startswith("no variant qualifies")
    first = judge(board_with(score("q", 1.0, 30)), None, trials(STEADY), SelectConfig())
    assert first.passed and first.reason.startswith("no production version yet; q: best latency")


def test_objective_samples_follow_the_objective():
    measured = trials(STEADY[:3], rss=400.0, top_batch=250.0)
    assert objective_samples(measured, "latency") == STEADY[:3]
    assert objective_samples(measured, "throughput") == [250.0] * 3
    assert objective_samples(measured, "memory") == [1 / 400.0]
    with_served = [
        replace(trial, served=[served(50.0, clients=1), served(160.0 + i)])
        for i, trial in enumerate(measured)
    ]
    assert objective_samples(with_served, "serving") == [160.0]  # one trial (three runs): its 16 clients
    slo = [replace(trial, served=[served(160.0, goodput=1.25)]) for trial in measured]
    assert objective_samples(slo, "serving") == [1.25]  # goodput where the SLO was set


def test_a_numerically_equal_twin_in_a_faster_engine_is_not_refused_for_accuracy():
    """An fp32 model in another engine scores ~1e-6 apart from its torch twin on every window: not a loss."""
    champion_score, twin = score("production-v1", 1.0, 100), score("onnx_fp32", 1.000001, 300)
    verdict = judge(
        board_with(champion_score, twin),
        Champion("1", "production-v1", champion_score, trials(STEADY)),
        trials([s * 3 for s in STEADY]),
        SelectConfig(),
    )
    assert verdict.evidence["ppl_ratio_vs_champion_ci"][0] > 1.0 and verdict.passed


def test_no_request_within_the_slo_is_no_evidence_and_moves_nothing():
    """Under the serving objective with an SLO, a model whose goodput is zero in a trial gives no ratio: refused."""
    champion_score, challenger = score("production-v1", 1.0, 100), score("fast", 1.0, 300)
    zero = [replace(t, served=[served(100.0, goodput=0.0)]) for t in trials(STEADY)]
    some = [replace(t, served=[served(300.0, goodput=2.0)]) for t in trials(STEADY)]
    board = board_with(champion_score, challenger)
    board = replace(board, objective="serving")
    verdict = judge(
        board, Champion("1", "production-v1", None, zero), some, SelectConfig(objective="serving")
    )
    assert not verdict.passed and "serving ×" in verdict.reason

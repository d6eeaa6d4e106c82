import math

import pytest

from tasks.config import SelectConfig
from tasks.decide.registry import gate_verdict
from tasks.decide.select import VariantScore, build_leaderboard

TOKENS = (100,) * 8
BASE_NLL = tuple(
    math.log(10.0) * 100 * (1 + 0.1 * (i % 3)) for i in range(8)
)  # windows of unequal difficulty


CLOZE = (True,) * 30 + (False,) * 34  # the baseline gets 30 of 64 cloze items right


def score(
    name: str, ratio: float, speed: float, per_window: list | None = None, cloze: tuple = CLOZE
) -> VariantScore:
    """A variant whose perplexity is `ratio` × the baseline's (per window, unless `per_window` ratios are given)."""
    ratios = per_window or [ratio] * len(TOKENS)
    nll = tuple(b + math.log(r) * t for b, r, t in zip(BASE_NLL, ratios, TOKENS, strict=True))
    perplexity = math.exp(sum(nll) / sum(TOKENS))
    accuracy = sum(cloze) / len(cloze)
    return VariantScore(
        name,
        perplexity,
        0.9,
        accuracy,
        speed,
        10.0,
        1000,
        1.0,
        10,
        window_nll=nll,
        window_tokens=TOKENS,
        cloze_correct=cloze,
    )


def test_fastest_variant_within_the_budget_wins():
    board = build_leaderboard(
        [score("baseline", 1.0, 10), score("fast_but_bad", 1.2, 50), score("ok", 1.04, 30)],
        SelectConfig(max_ppl_increase=0.05),
    )
    assert board.winner == "ok"
    assert [r.score.variant for r in board.rows] == ["fast_but_bad", "ok", "baseline"]
    assert not board.rows[0].within_budget
    assert board.rows[1].speedup == pytest.approx(3.0)
    assert board.rows[1].ppl_ratio == pytest.approx(1.04)
    assert gate_verdict(board).passed


def test_gate_refuses_when_ci_upper_bound_exceeds_threshold():
    """Point estimate 1.04 is inside a 5 % budget, but half the windows regress by 8 %: not proven safe."""
    uneven = score("uneven", 0, 30, per_window=[1.0, 1.08] * 4)
    board = build_leaderboard([score("baseline", 1.0, 10), uneven], SelectConfig(max_ppl_increase=0.05))
    row = next(r for r in board.rows if r.score.variant == "uneven")
    assert row.ppl_ratio < 1.05 < row.ppl_ratio_high
    assert not row.within_budget
    assert board.winner == "baseline"


def test_gate_refuses_a_variant_significantly_worse_on_cloze():
    """Perplexity identical, but 12 items the baseline answered are now wrong and none gained: McNemar p < 0.001."""
    worse = score("worse", 1.0, 30, cloze=(False,) * 12 + (True,) * 18 + (False,) * 34)
    board = build_leaderboard([score("baseline", 1.0, 10), worse], SelectConfig())
    row = next(r for r in board.rows if r.score.variant == "worse")
    assert row.cloze_p_value < 0.001 and row.cloze_delta == pytest.approx(-12 / 64)
    assert board.winner == "baseline"


def test_a_small_cloze_difference_does_not_block_a_variant():
    slightly = score("slightly", 1.0, 30, cloze=(False,) * 2 + (True,) * 28 + (False,) * 34)
    board = build_leaderboard([score("baseline", 1.0, 10), slightly], SelectConfig())
    assert board.rows[0].cloze_p_value == pytest.approx(0.5)
    assert board.winner == "slightly"


def test_baseline_wins_when_every_variant_exceeds_the_budget():
    board = build_leaderboard([score("baseline", 1.0, 10), score("q", 2.0, 40)], SelectConfig())
    assert board.winner == "baseline"
    assert gate_verdict(board).passed


def test_reports_render_every_variant_with_its_interval():
    board = build_leaderboard([score("baseline", 1.0, 10), score("q", 1.01, 40)], SelectConfig())
    assert "q ★" in board.to_markdown()
    assert "1.010 (1.010–1.010)" in board.to_markdown()
    assert board.to_csv().count("\n") == 3
    assert board.metrics()["q"]["ppl_ratio"] == pytest.approx(1.01)
    assert board.metrics()["q"]["ppl_ratio_ci_high"] == pytest.approx(1.01)


def test_winner_summary_states_speedup_and_accuracy_cost():
    board = build_leaderboard([score("baseline", 1.0, 10), score("q", 1.02, 25)], SelectConfig())
    assert board.winner_summary().startswith("q: 25.0 decode tok/s (2.50× baseline), perplexity ")
    assert "(×1.020, 95% CI 1.020–1.020)" in board.winner_summary()

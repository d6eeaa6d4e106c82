import math

import pytest

from tasks.config import SelectConfig
from tasks.errors import GateError
from tasks.registry import gate_verdict
from tasks.select import VariantScore, build_leaderboard


def score(name: str, ppl: float, speed: float) -> VariantScore:
    return VariantScore(name, ppl, speed, ttft_ms=10.0, size_bytes=1000, peak_rss_mb=1.0, parameters=10)


def test_fastest_variant_within_the_budget_wins():
    board = build_leaderboard(
        [score("baseline", 10.0, 10), score("fast_but_bad", 12.0, 50), score("ok", 10.4, 30)],
        SelectConfig(max_ppl_increase=0.05),
    )
    assert board.winner == "ok"
    assert [r.score.variant for r in board.rows] == ["fast_but_bad", "ok", "baseline"]
    assert not board.rows[0].within_budget
    assert board.rows[1].speedup == pytest.approx(3.0)
    assert gate_verdict(board).passed


def test_baseline_wins_when_every_variant_exceeds_the_budget():
    board = build_leaderboard([score("baseline", 10.0, 10), score("q", 20.0, 40)], SelectConfig())
    assert board.winner == "baseline"


def test_non_finite_metrics_are_refused():
    with pytest.raises(GateError, match="non-finite"):
        build_leaderboard([score("baseline", 10.0, 10), score("q", math.nan, 40)], SelectConfig())


def test_reports_render_every_variant():
    board = build_leaderboard([score("baseline", 10.0, 10), score("q", 10.1, 40)], SelectConfig())
    assert "q ★" in board.to_markdown()
    assert board.to_csv().count("\n") == 3
    assert board.metrics()["q"]["ppl_ratio"] == pytest.approx(1.01)


def test_winner_summary_states_speedup_and_accuracy_cost():
    board = build_leaderboard([score("baseline", 10.0, 10), score("q", 10.2, 25)], SelectConfig())
    assert board.winner_summary() == "q: 25.0 decode tok/s (2.50× baseline), perplexity 10.20 (×1.020), 0 MB"

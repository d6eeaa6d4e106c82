import math
import random
from dataclasses import replace

import pytest

from tasks.config import SelectConfig
from tasks.decide.frontier import pareto_frontier
from tasks.decide.select import VariantScore, build_leaderboard
from tasks.measure.served import LevelResult

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


def test_baseline_is_the_run_s_winner_when_every_variant_exceeds_the_budget():
    """The run's winner, not a promotion: the champion/challenger gate decides that (tests/unit/test_gate.py)."""
    board = build_leaderboard([score("baseline", 1.0, 10), score("q", 2.0, 40)], SelectConfig())
    assert board.winner == "baseline"
    assert board.row("q").failures == ("perplexity ratio CI upper bound 2.000 > 1.050",)


def test_nothing_wins_when_no_variant_meets_the_constraints_and_the_reason_names_them():
    board = build_leaderboard(
        [score("baseline", 1.0, 10), score("q", 1.0, 15)], SelectConfig(min_speedup=2.0, max_size_mb=0.0001)
    )
    assert board.winner is None
    assert "q: size 0 MB > max_size_mb 0.0001, speedup 1.50 < min_speedup 2" in board.reason
    assert all(not row.qualifies for row in board.rows)


def served(tok_s: float, ttft_p95_ms: float = 500.0, goodput: float = float("nan"), clients: int = 16):
    """One served level as the benchmark's served measurement reports it."""
    return LevelResult(
        clients,
        16,
        0,
        10.0,
        1.6,
        tok_s,
        200.0,
        ttft_p95_ms,
        900.0,
        1500.0,
        float("nan"),
        float("nan"),
        goodput_rps=goodput,
    )


def scenario_scores() -> list[VariantScore]:
    """Three shapes of variant: fast alone, fast in batches, small."""
    lone = replace(score("lone", 1.0, 50), batch_decode_tok_s=((1, 50.0), (8, 120.0)), peak_rss_mb=900.0)
    batch = replace(score("batch", 1.0, 30), batch_decode_tok_s=((1, 30.0), (8, 300.0)), peak_rss_mb=800.0)
    small = replace(score("small", 1.0, 20), batch_decode_tok_s=((1, 20.0), (8, 100.0)), peak_rss_mb=300.0)
    base = replace(score("baseline", 1.0, 10), batch_decode_tok_s=((1, 10.0), (8, 50.0)), peak_rss_mb=1000.0)
    # served to 16 clients, prompts arriving while others decode: "server" beats "batch" there
    server = replace(score("server", 1.0, 25), batch_decode_tok_s=((1, 25.0), (8, 250.0)), peak_rss_mb=850.0)
    levels = {"lone": 100.0, "batch": 150.0, "small": 60.0, "baseline": 40.0, "server": 200.0}
    return [
        replace(s, served=(served(levels[s.variant] / 2, clients=1), served(levels[s.variant])))
        for s in (base, lone, batch, small, server)
    ]


@pytest.mark.parametrize(
    ("objective", "winner"),
    [("latency", "lone"), ("throughput", "batch"), ("memory", "small"), ("serving", "server")],
)
def test_the_same_scores_select_the_winner_each_objective_asks_for(objective, winner):
    board = build_leaderboard(scenario_scores(), SelectConfig(objective=objective))
    assert board.winner == winner and board.row(winner).on_frontier
    assert not board.row("baseline").on_frontier  # dominated by every other variant
    assert f"best {objective} of 5 qualifying variants" == board.reason


def test_serving_ranks_by_goodput_under_the_slo_where_one_was_set_and_says_so():
    """Goodput (requests/s within the SLO) decides over raw tok/s: the faster server that misses the TTFT
    bound for most requests loses to the one that meets it."""
    base = replace(score("baseline", 1.0, 10), served=(served(40.0, goodput=0.5),))
    fast = replace(score("fast", 1.0, 30), served=(served(300.0, ttft_p95_ms=4000, goodput=0.4),))
    steady = replace(score("steady", 1.0, 20), served=(served(200.0, ttft_p95_ms=900, goodput=1.5),))
    board = build_leaderboard([base, fast, steady], SelectConfig(objective="serving"))
    assert board.winner == "steady" and board.row("steady").speedup == pytest.approx(3.0)
    assert (
        "1.50 req/s within the SLO, 200.0 tok/s served to 16 clients (3.00× baseline)"
        in board.winner_summary()
    )


def test_serving_columns_show_the_most_clients_and_rows_without_them_cannot_win_on_serving():
    rows = scenario_scores()
    unmeasured = replace(rows[2], served=())  # "batch": e.g. a model whose served measurement did not run
    board = build_leaderboard([*rows[:2], unmeasured, *rows[3:]], SelectConfig(objective="serving"))
    assert "no served capacity measured (objective: serving)" in board.row("batch").failures
    assert board.rows[-1].score.variant == "batch"  # ranks below every measured row
    markdown = board.to_markdown()
    assert "| c16 tok/s | c16 TTFT p95 |" in markdown and "c16: served to 16 clients" in markdown
    batch_line = next(line for line in markdown.splitlines() if line.startswith("| batch"))
    assert batch_line.count("| – ") >= 3  # speedup, served tok/s and TTFT p95: not measured
    metrics = board.metrics()
    assert metrics["server"]["served_tok_s_c16"] == 200.0 and metrics["server"]["served_tok_s_c1"] == 100.0
    assert "served_tok_s_c16" not in metrics["batch"]
    latency = build_leaderboard([*rows[:2], unmeasured, *rows[3:]], SelectConfig(objective="latency"))
    assert latency.row("batch").qualifies  # served capacity decides only when it is the objective


def test_without_served_measurements_the_table_keeps_its_columns():
    board = build_leaderboard([replace(s, served=()) for s in scenario_scores()], SelectConfig())
    assert "c16" not in board.to_markdown() and "c16" not in board.to_csv()


def brute_force_frontier(points: dict[str, tuple[float, float, float]]) -> set[str]:
    """By definition: a point is out when some other point is at least as good everywhere and not identical."""
    out = set()
    for name, (ppl, speed, rss) in points.items():
        for other, (o_ppl, o_speed, o_rss) in points.items():
            as_good = o_ppl <= ppl and o_speed >= speed and o_rss <= rss
            if other != name and as_good and (o_ppl, o_speed, o_rss) != (ppl, speed, rss):
                out.add(name)
    return set(points) - out


@pytest.mark.parametrize("seed", range(20))
def test_the_frontier_equals_the_brute_force_frontier(seed):
    rng = random.Random(seed)
    points = {
        f"v{i}": (
            rng.choice([1.0, 1.01, 1.02, 1.1]),
            rng.choice([10.0, 20.0, 30.0]),
            rng.choice([100.0, 200.0]),
        )
        for i in range(rng.randint(1, 12))
    }
    assert set(pareto_frontier(points)) == brute_force_frontier(points)


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


def test_the_peer_row_is_ranked_but_never_wins():
    peer = replace(score("gguf_shipped", 1.0, 90), peer=True)
    board = build_leaderboard(
        [score("baseline", 1.0, 10), peer, score("ok", 1.02, 30)], SelectConfig(max_ppl_increase=0.05)
    )
    assert board.winner == "ok" and board.rows[0].score.variant == "gguf_shipped"
    assert board.rows[0].within_budget and board.rows[0].failures[0].startswith("peer row")


@pytest.mark.parametrize(
    ("setting", "field", "failure"),
    [
        ("max_ttft_ms", "ttft_ms", "TTFT 300 ms > max_ttft_ms 100"),
        ("max_rss_mb", "peak_rss_mb", "peak RSS 300 MB > max_rss_mb 100"),
    ],
)
def test_a_variant_over_a_latency_or_memory_constraint_is_excluded_and_its_row_says_why(
    setting, field, failure
):
    """The fastest variant breaks the constraint; one exactly at the limit meets it and wins."""
    over = replace(score("over", 1.0, 50), **{field: 300.0})
    at_limit = replace(score("at_limit", 1.0, 30), **{field: 100.0})
    scores = [score("baseline", 1.0, 10), over, at_limit]
    assert build_leaderboard(scores, SelectConfig()).winner == "over"  # unconstrained, speed decides
    board = build_leaderboard(scores, SelectConfig(**{setting: 100.0}))
    assert board.winner == "at_limit"
    assert board.row("over").within_budget and board.row("over").failures == (failure,)
    assert not board.row("over").qualifies and board.row("at_limit").failures == ()
    assert board.reason == "best latency of 2 qualifying variants"
    assert failure in board.to_csv()


def tied(name: str, ratio: float, speed: float, rss: float) -> VariantScore:
    """A variant measured at `speed` alone and 4 × `speed` at batch 8, with `rss` MB peak memory."""
    return replace(
        score(name, ratio, speed), batch_decode_tok_s=((1, speed), (8, 4 * speed)), peak_rss_mb=rss
    )


@pytest.mark.parametrize("objective", ["latency", "throughput", "memory"])
@pytest.mark.parametrize("accurate_first", [True, False])
def test_when_the_objective_ties_the_more_accurate_variant_wins(objective, accurate_first):
    """Equal on the objective's measure (for memory: peak RSS and size, and the less accurate one is faster)."""
    accurate = tied("accurate", 1.01, 30, 500.0)
    sloppy = tied("sloppy", 1.03, 40 if objective == "memory" else 30, 500.0)
    pair = [accurate, sloppy] if accurate_first else [sloppy, accurate]
    board = build_leaderboard([tied("baseline", 1.0, 10, 1000.0), *pair], SelectConfig(objective=objective))
    order = [row.score.variant for row in board.rows]
    assert board.row("sloppy").qualifies and board.winner == "accurate"
    assert order.index("accurate") < order.index("sloppy")


@pytest.mark.parametrize("objective", ["latency", "throughput"])
@pytest.mark.parametrize("lean_first", [True, False])
def test_when_the_objective_and_accuracy_tie_the_variant_using_less_memory_wins(objective, lean_first):
    lean, heavy = tied("lean", 1.01, 30, 400.0), tied("heavy", 1.01, 30, 600.0)
    pair = [lean, heavy] if lean_first else [heavy, lean]
    board = build_leaderboard([tied("baseline", 1.0, 10, 1000.0), *pair], SelectConfig(objective=objective))
    assert board.row("heavy").qualifies and board.winner == "lean"
    assert board.row("lean").on_frontier and not board.row("heavy").on_frontier


def test_the_accuracy_check_before_benchmarking_is_the_leaderboards():
    """`outside_budget` decides on the evaluations alone (before any benchmark) what the leaderboard decides
    later: the same interval, the same verdict for the same windows and cloze items."""
    from types import SimpleNamespace

    from tasks.decide.accuracy import evaluation_accuracy

    cfg = SelectConfig(max_ppl_increase=0.05)
    scores = [
        score("baseline", 1.0, 10),
        score("ok", 1.04, 30),
        score("uneven", 0, 30, per_window=[1.0, 1.08] * 4),
    ]
    scores.append(score("worse", 1.0, 30, cloze=(False,) * 12 + (True,) * 18 + (False,) * 34))
    board = build_leaderboard(scores, cfg)

    def evaluation(s: VariantScore):
        perplexity = SimpleNamespace(window_nll=list(s.window_nll), window_tokens=list(s.window_tokens))
        return SimpleNamespace(
            perplexity=perplexity,
            cloze=SimpleNamespace(correct=list(s.cloze_correct)),
            long_context={},
            retrieval={},
        )

    for s in scores[1:]:
        check = evaluation_accuracy(evaluation(scores[0]), evaluation(s), cfg)
        row = board.row(s.variant)
        assert (check.within_budget, check.interval.high) == (row.within_budget, row.ppl_ratio_high)
    assert [s.variant for s in scores if not board.row(s.variant).within_budget] == ["uneven", "worse"]


def test_a_short_benchmarked_row_is_marked_and_shows_no_batched_speed():
    fast = replace(
        score("fast_but_bad", 1.2, 50), batch_decode_tok_s=((1, 50.0), (4, 90.0)), short_benchmark=True
    )
    full = replace(score("ok", 1.04, 30), batch_decode_tok_s=((1, 30.0), (8, 120.0)))
    base = replace(score("baseline", 1.0, 10), batch_decode_tok_s=((1, 10.0), (8, 40.0)))
    board = build_leaderboard([base, fast, full], SelectConfig(max_ppl_increase=0.05))
    from tasks.decide.leaderboard_table import table_cells, table_columns

    columns = table_columns(board)
    cells = {c[0].split(" ")[0]: dict(zip(columns, c, strict=True)) for c in table_cells(board)}
    assert "tok/s bs8" in columns and board.winner == "ok"
    assert cells["fast_but_bad"]["variant"] == "fast_but_bad ◆ ✗ ⏱"
    assert cells["fast_but_bad"]["tok/s bs8"] == "–" and cells["ok"]["tok/s bs8"] == "120.0"
    assert (
        cells["fast_but_bad"]["p95 ms"] == "–" and cells["ok"]["p95 ms"] != "–"
    )  # too few requests for a p95
    assert (
        "latency_p95_ms" not in board.metrics()["fast_but_bad"] and "latency_p95_ms" in board.metrics()["ok"]
    )
    import csv

    rows = {r["variant"].split(" ")[0]: r for r in csv.DictReader(board.to_csv().splitlines())}
    assert (
        rows["fast_but_bad"]["p95 ms"] == rows["fast_but_bad"]["tok/s bs8"] == ""
    )  # blank, for tools reading it
    assert (
        "⏱ short benchmark" in board.to_markdown()
        and "⏱" not in build_leaderboard([base, full], SelectConfig()).legend()
    )


def test_the_short_benchmark_keeps_the_columns_it_reports_comparable():
    """Batch 1 and the largest batch (throughput and that batch's memory), the shortest and longest TTFT prompts
    (the request set spans the same lengths), a third of the requests; batch 1 measured as fully as ever."""
    from tasks.config import BenchmarkConfig

    short = BenchmarkConfig().short()
    assert (short.batch_sizes, short.ttft_prompt_tokens, short.requests) == ([1, 8], [32, 512], 3)
    assert (short.repeats, short.new_tokens, short.prompt_tokens) == (3, 32, 128)
    assert BenchmarkConfig(batch_sizes=[1], ttft_prompt_tokens=[64]).short().batch_sizes == [1]


def test_only_this_runs_own_refused_variants_get_the_short_benchmark(tmp_path):
    """Outside the budget → short; but never the baseline, the peer row, or a variant standing in for production
    (its trials feed the gate, which compares like with like)."""
    from types import SimpleNamespace

    from tasks.measure.plan import outside_budget
    from tasks.params_file import load_config

    params = tmp_path / "params.yaml"
    params.write_text(
        "variants:\n  baseline: {}\n  good: {}\n  bad: {}\n  production_bytes: {}\n"
        "  peer: {steps: [{llama_cpp: {type: shipped}}]}\n"
    )
    config = load_config(params)
    ratios = {"baseline": 1.0, "good": 1.01, "bad": 1.2, "production_bytes": 1.2, "peer": 1.2}

    def evaluation(ratio: float):
        s = score("x", ratio, 1.0)
        perplexity = SimpleNamespace(window_nll=list(s.window_nll), window_tokens=list(s.window_tokens))
        return SimpleNamespace(
            perplexity=perplexity,
            cloze=SimpleNamespace(correct=list(s.cloze_correct)),
            long_context={},
            retrieval={},
        )

    evaluations = {name: evaluation(ratio) for name, ratio in ratios.items()}
    manifests = {
        name: SimpleNamespace(recipe=config.variants[name].model_dump(exclude_defaults=True))
        for name in ratios
    }
    assert outside_budget(config, manifests, evaluations, exclude={"production_bytes"}) == ["bad"]
    assert outside_budget(config, manifests, evaluations, exclude=set()) == ["bad", "production_bytes"]


def test_on_a_gpu_the_memory_objective_and_max_gpu_mb_read_gpu_memory_and_the_table_shows_it():
    """A cuda target's benchmark records peak GPU memory: `memory` ranks by it (not by the host's RSS), `max_gpu_mb`
    bounds it, and the leaderboard gets a peak GPU MB column (absent where no row measured it)."""
    base = replace(score("baseline", 1.0, 10), peak_rss_mb=900.0, peak_gpu_mb=4000.0)
    int8 = replace(score("int8", 1.01, 12), peak_rss_mb=2000.0, peak_gpu_mb=2200.0)  # more host RSS, less GPU
    int4 = replace(score("int4", 1.02, 14), peak_rss_mb=3000.0, peak_gpu_mb=1500.0)
    board = build_leaderboard([base, int8, int4], SelectConfig(objective="memory"))
    assert [row.score.variant for row in board.rows] == [
        "int4",
        "int8",
        "baseline",
    ] and board.winner == "int4"
    assert board.metrics()["int4"]["peak_gpu_mb"] == 1500.0
    assert "peak GPU MB" in board.to_markdown() and "1500" in board.to_markdown()
    bounded = build_leaderboard([base, int8, int4], SelectConfig(max_gpu_mb=1000.0))
    assert bounded.winner is None
    assert any("peak GPU memory 1500 MB > max_gpu_mb 1000" in failure for failure in bounded.rows[0].failures)
    on_cpu = build_leaderboard([score("baseline", 1.0, 10), score("int8", 1.01, 12)], SelectConfig())
    assert "peak GPU MB" not in on_cpu.to_markdown() and "peak_gpu_mb" not in on_cpu.metrics()["int8"]


def test_max_gpu_mb_on_a_cpu_target_is_refused_naming_the_key():
    from tasks.params import Config

    with pytest.raises(ValueError, match="select.max_gpu_mb bounds GPU memory"):
        Config.model_validate({"select": {"max_gpu_mb": 2000}, "variants": {"baseline": {}}})
    assert (
        Config.model_validate(
            {"select": {"max_gpu_mb": 2000}, "target": {"device": "cuda"}, "variants": {"baseline": {}}}
        ).select.max_gpu_mb
        == 2000
    )

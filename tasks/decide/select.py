"""select: the leaderboard, and the fastest variant whose perplexity stays within the allowed increase."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass

from tasks.config import SelectConfig
from tasks.decide.statistics import mcnemar_exact, paired_bootstrap_ppl_ratio
from tasks.engines.manifest import VariantManifest
from tasks.errors import ComparisonError
from tasks.measure.benchmark import BenchmarkResult, roofline_fraction
from tasks.measure.evaluate import VariantEvaluation


@dataclass(frozen=True)
class VariantScore:
    """One leaderboard row: what selection needs to know about a variant."""

    variant: str
    perplexity: float
    token_agreement: float  # greedy continuations matching the baseline's, position by position
    cloze_accuracy: float
    decode_tok_s: float
    ttft_ms: float
    size_bytes: int
    peak_rss_mb: float
    parameters: int
    window_nll: tuple[float, ...]  # per evaluation window, for paired comparisons
    window_tokens: tuple[int, ...]
    cloze_correct: tuple[bool, ...]  # per cloze item, for McNemar's paired test
    # Speed beyond batch 1 (NaN/empty when not measured: the metrics suite refuses missing values)
    batch_decode_tok_s: tuple[tuple[int, float], ...] = ()  # (batch size, aggregate decode tok/s)
    ttft_ms_by_prompt: tuple[tuple[int, float], ...] = ()  # (prompt tokens, median TTFT ms)
    latency_p95_ms: float = float("nan")  # end-to-end, fixed request set
    roofline_fraction: float = float("nan")  # decode tok/s ÷ (memory bandwidth ÷ weight bytes)

    def top_batch(self) -> tuple[int, float]:
        """(largest measured batch size, its aggregate decode tok/s)."""
        return max(self.batch_decode_tok_s, default=(1, self.decode_tok_s))


def variant_score(
    name: str,
    manifest: VariantManifest,
    evaluation: VariantEvaluation,
    bench: BenchmarkResult,
    bandwidth_gbs: float,
) -> VariantScore:
    """The leaderboard row of one measured variant."""
    return VariantScore(
        variant=name,
        perplexity=evaluation.perplexity.perplexity,
        token_agreement=evaluation.agreement.token_agreement,
        cloze_accuracy=evaluation.cloze.accuracy,
        cloze_correct=tuple(evaluation.cloze.correct),
        decode_tok_s=bench.decode_tok_s,
        ttft_ms=bench.ttft_ms,
        size_bytes=manifest.size_bytes,
        peak_rss_mb=bench.peak_rss_mb,
        parameters=manifest.parameters,
        window_nll=tuple(evaluation.perplexity.window_nll),
        window_tokens=tuple(evaluation.perplexity.window_tokens),
        batch_decode_tok_s=tuple((b.batch_size, b.decode_tok_s) for b in bench.batches),
        ttft_ms_by_prompt=tuple(sorted(bench.ttft_ms_by_prompt.items())),
        latency_p95_ms=bench.latency_ms["p95"],
        roofline_fraction=roofline_fraction(bench.decode_tok_s, bench.decode_read_bytes, bandwidth_gbs),
    )


@dataclass(frozen=True)
class LeaderboardRow:
    score: VariantScore
    ppl_ratio: float
    ppl_ratio_low: float
    ppl_ratio_high: float
    cloze_p_value: float  # McNemar exact test vs the baseline
    cloze_delta: float
    speedup: float
    within_budget: bool  # the upper confidence bound of the perplexity ratio is within the budget


@dataclass(frozen=True)
class Leaderboard:
    rows: list[LeaderboardRow]
    baseline: str
    winner: str
    max_ppl_increase: float
    confidence: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def winner_summary(self) -> str:
        """One sentence on the winner, for the registry's version description."""
        row = next(r for r in self.rows if r.score.variant == self.winner)
        return (
            f"{self.winner}: {row.score.decode_tok_s:.1f} decode tok/s ({row.speedup:.2f}× {self.baseline}), "
            f"perplexity {row.score.perplexity:.2f} (×{row.ppl_ratio:.3f}, {self.confidence:.0%} CI "
            f"{row.ppl_ratio_low:.3f}–{row.ppl_ratio_high:.3f}), {row.score.size_bytes / 1e6:.0f} MB"
        )

    def metrics(self) -> dict[str, dict[str, float]]:
        """Numbers only, keyed by variant: the shape `dvc metrics show/diff` reads."""
        return {
            row.score.variant: {
                "perplexity": round(row.score.perplexity, 4),
                "token_agreement": round(row.score.token_agreement, 4),
                "cloze_accuracy": round(row.score.cloze_accuracy, 4),
                "cloze_p_value": round(row.cloze_p_value, 4),
                "ppl_ratio": round(row.ppl_ratio, 4),
                "ppl_ratio_ci_low": round(row.ppl_ratio_low, 4),
                "ppl_ratio_ci_high": round(row.ppl_ratio_high, 4),
                "decode_tok_s": round(row.score.decode_tok_s, 2),
                **{f"decode_tok_s_bs{b}": round(v, 2) for b, v in row.score.batch_decode_tok_s},
                "ttft_ms": round(row.score.ttft_ms, 1),
                **{f"ttft_ms_prompt{n}": round(v, 1) for n, v in row.score.ttft_ms_by_prompt},
                "latency_p95_ms": round(row.score.latency_p95_ms, 1),
                "roofline_fraction": round(row.score.roofline_fraction, 4),
                "size_mb": round(row.score.size_bytes / 1e6, 1),
                "peak_rss_mb": round(row.score.peak_rss_mb, 1),
            }
            for row in self.rows
        }

    def to_csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow([*table_columns(self), "parameters", "within_budget"])
        for cells, row in zip(table_cells(self), self.rows, strict=True):
            writer.writerow([*cells, row.score.parameters, row.within_budget])
        return buffer.getvalue()

    def to_markdown(self) -> str:
        columns = table_columns(self)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cells) + " |" for cells in table_cells(self)]
        return "\n".join(lines) + f"\n\nWinner: **{self.winner}** (reference: {self.baseline}).\n"


def table_columns(board: Leaderboard) -> list[str]:
    """Column headers; the batched-speed column names the largest measured batch size."""
    top = board.rows[0].score.top_batch()[0] if board.rows else 1
    return [
        "variant",
        "perplexity",
        "ppl × (CI)",
        "agree %",
        "cloze (p)",
        "tok/s bs1",
        f"tok/s bs{top}",
        "speedup",
        "TTFT ms",
        "p95 ms",
        "roofline",
        "size MB",
        "peak RSS MB",
    ]


def table_cells(board: Leaderboard) -> list[list[str]]:
    """Formatted cells of every row, shared by the terminal, markdown and CSV renderings."""
    cells = []
    for row in board.rows:
        s = row.score
        mark = " ★" if s.variant == board.winner else ("" if row.within_budget else " ✗")
        cells.append(
            [
                s.variant + mark,
                f"{s.perplexity:.2f}",
                f"{row.ppl_ratio:.3f} ({row.ppl_ratio_low:.3f}–{row.ppl_ratio_high:.3f})",
                f"{s.token_agreement:.0%}",
                f"{s.cloze_accuracy:.0%} (p={row.cloze_p_value:.2f})",
                f"{s.decode_tok_s:.1f}",
                f"{s.top_batch()[1]:.1f}",
                f"{row.speedup:.2f}",
                f"{s.ttft_ms:.0f}",
                f"{s.latency_p95_ms:.0f}",
                f"{s.roofline_fraction:.0%}",
                f"{s.size_bytes / 1e6:.0f}",
                f"{s.peak_rss_mb:.0f}",
            ]
        )
    return cells


def build_leaderboard(scores: list[VariantScore], cfg: SelectConfig) -> Leaderboard:
    """Rank by decode speed; the winner is the fastest variant whose perplexity ratio to the baseline stays
    within the budget at the configured confidence (upper bound of the paired bootstrap interval) and whose cloze
    accuracy is not significantly worse (McNemar exact test at the same confidence).

    The metrics are expected to have passed `validate_metrics_table` (finite, positive, all variants present).
    """
    by_name = {s.variant: s for s in scores}
    if cfg.baseline not in by_name:
        raise ComparisonError(f"select: baseline {cfg.baseline!r} has no measurements")
    base = by_name[cfg.baseline]
    rows = [_row(s, base, cfg) for s in sorted(scores, key=lambda s: s.decode_tok_s, reverse=True)]
    winner = next(row.score.variant for row in rows if row.within_budget)
    return Leaderboard(rows, cfg.baseline, winner, cfg.max_ppl_increase, cfg.confidence)


def _row(score: VariantScore, base: VariantScore, cfg: SelectConfig) -> LeaderboardRow:
    interval = paired_bootstrap_ppl_ratio(
        list(base.window_nll),
        list(base.window_tokens),
        list(score.window_nll),
        list(score.window_tokens),
        cfg.bootstrap_resamples,
        cfg.confidence,
        cfg.seed,
    )
    cloze = mcnemar_exact(list(base.cloze_correct), list(score.cloze_correct))
    significantly_worse = cloze.accuracy_delta < 0 and cloze.p_value < 1 - cfg.confidence
    is_baseline = score.variant == cfg.baseline
    return LeaderboardRow(
        score=score,
        ppl_ratio=interval.ratio,
        ppl_ratio_low=interval.low,
        ppl_ratio_high=interval.high,
        cloze_p_value=cloze.p_value,
        cloze_delta=cloze.accuracy_delta,
        speedup=score.decode_tok_s / base.decode_tok_s,
        within_budget=is_baseline or (interval.high <= 1 + cfg.max_ppl_increase and not significantly_worse),
    )

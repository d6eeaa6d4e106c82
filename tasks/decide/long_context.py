"""Long-context accuracy on the leaderboard, only where it was measured (`long_context:` set): each length's tail
perplexity and its ratio to the baseline's, paired per document with the same bootstrap as the short windows."""

from __future__ import annotations

from typing import Any

from tasks.config import SelectConfig
from tasks.decide.statistics import paired_bootstrap_ppl_ratio
from tasks.measure.evaluate import VariantEvaluation

# (window length, tail perplexity, per-document tail NLL, per-document tail tokens)
LengthScore = tuple[int, float, tuple[float, ...], tuple[int, ...]]
# (window length, tail perplexity, ratio to the baseline's, interval low, interval high)
LengthRatio = tuple[int, float, float, float, float]


def length_scores(evaluation: VariantEvaluation) -> tuple[LengthScore, ...]:
    """The evaluation's tail perplexities by length, shortest first (empty: not measured)."""
    by_length = sorted(evaluation.long_context.items(), key=lambda item: int(item[0]))
    return tuple(
        (int(length), r.perplexity, tuple(r.window_nll), tuple(r.window_tokens)) for length, r in by_length
    )


def length_ratios(
    scores: tuple[LengthScore, ...], base: tuple[LengthScore, ...], cfg: SelectConfig
) -> tuple[LengthRatio, ...]:
    """Each length's perplexity ratio to the baseline's on the same documents, with its paired interval."""
    base_by_length = {length: (nll, tokens) for length, _, nll, tokens in base}
    ratios = []
    for length, perplexity, nll, tokens in scores:
        if length not in base_by_length or len(base_by_length[length][0]) != len(nll):
            continue  # measured on other documents: nothing to pair with
        base_nll, base_tokens = base_by_length[length]
        interval = paired_bootstrap_ppl_ratio(
            list(base_nll),
            list(base_tokens),
            list(nll),
            list(tokens),
            cfg.bootstrap_resamples,
            cfg.confidence,
            cfg.seed,
        )
        ratios.append((length, perplexity, interval.ratio, interval.low, interval.high))
    return tuple(ratios)


def length_metrics(ratios: tuple[LengthRatio, ...]) -> dict[str, float]:
    """MLflow / DVC metrics: `ppl_ctx<L>`, `ppl_ratio_ctx<L>` and its interval, per length."""
    metrics = {}
    for length, perplexity, ratio, low, high in ratios:
        metrics |= {
            f"ppl_ctx{length}": round(perplexity, 4),
            f"ppl_ratio_ctx{length}": round(ratio, 4),
            f"ppl_ratio_ctx{length}_ci_low": round(low, 4),
            f"ppl_ratio_ctx{length}_ci_high": round(high, 4),
        }
    return metrics


def longest_measured(rows: list[Any]) -> int | None:
    """The longest length every row was measured at (None: long context not measured)."""
    lengths = [{length for length, *_ in row.long_context} for row in rows]
    common = set.intersection(*lengths) if lengths else set()
    return max(common) if common else None


def length_cell(ratios: tuple[LengthRatio, ...], length: int) -> str:
    """`perplexity ×ratio (low–high)` at `length`."""
    _, perplexity, ratio, low, high = next(r for r in ratios if r[0] == length)
    return f"{perplexity:.2f} ×{ratio:.3f} ({low:.3f}–{high:.3f})"

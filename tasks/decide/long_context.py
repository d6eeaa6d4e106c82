"""Long-context accuracy on the leaderboard, only where it was measured (`long_context:` set): each length's tail
perplexity and its ratio to the baseline's, paired per document with the same bootstrap as the short windows."""

from __future__ import annotations

from typing import Any

from tasks.config import SelectConfig
from tasks.decide.statistics import mcnemar_exact, paired_bootstrap_ppl_ratio
from tasks.measure.evaluate import VariantEvaluation
from tasks.measure.long_context import LengthSpeed

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


# (window length, each planted fact's depth, whether each was found), trials in the same order for every variant
RetrievalScore = tuple[int, tuple[float, ...], tuple[bool, ...]]


def retrieval_scores(evaluation: VariantEvaluation) -> tuple[RetrievalScore, ...]:
    """The planted facts' answers by length, shortest first (empty: not measured)."""
    by_length = sorted(evaluation.retrieval.items(), key=lambda item: int(item[0]))
    return tuple((int(length), tuple(r.depths), tuple(r.correct)) for length, r in by_length)


def by_depth(score: RetrievalScore) -> dict[float, float]:
    """Accuracy at each depth of one length."""
    _, depths, correct = score
    return {
        depth: sum(c for d, c in zip(depths, correct, strict=True) if d == depth) / depths.count(depth)
        for depth in sorted(set(depths))
    }


def paired_retrieval(
    scores: tuple[RetrievalScore, ...], base: tuple[RetrievalScore, ...]
) -> tuple[list[bool], list[bool]]:
    """(the baseline's answers, the variant's) over every length both answered the same facts at."""
    base_by_length = {length: (depths, correct) for length, depths, correct in base}
    pairs: tuple[list[bool], list[bool]] = ([], [])
    for length, depths, correct in scores:
        if base_by_length.get(length, ((), ()))[0] == depths:
            pairs[0].extend(base_by_length[length][1])
            pairs[1].extend(correct)
    return pairs


def long_context_failures(
    ratios: tuple[LengthRatio, ...],
    scores: tuple[RetrievalScore, ...],
    base: tuple[RetrievalScore, ...],
    cfg: SelectConfig,
) -> list[str]:
    """Where long context was measured, the accuracy budget holds there too: at each length the perplexity ratio's
    upper bound within `max_ppl_increase`, and the planted facts not found significantly less often than the
    baseline finds them (McNemar's exact test over every length's facts, at `confidence`)."""
    limit, failures = 1 + cfg.max_ppl_increase, []
    for length, _, _, _, high in ratios:
        if high > limit:
            failures.append(f"perplexity at {length} tokens: CI upper bound {high:.3f} > {limit:.3f}")
    base_correct, correct = paired_retrieval(scores, base)
    if correct:
        test = mcnemar_exact(base_correct, correct)
        if test.accuracy_delta < 0 and test.p_value < 1 - cfg.confidence:
            failures.append(
                f"planted facts found {sum(correct)}/{len(correct)}, the baseline {sum(base_correct)} "
                f"(McNemar p {test.p_value:.3f})"
            )
    return failures


def retrieval_metrics(scores: tuple[RetrievalScore, ...]) -> dict[str, float]:
    """MLflow / DVC metrics: `retrieval_ctx<L>` (share of facts found) and `retrieval_ctx<L>_depth<D>`."""
    metrics = {}
    for score in scores:
        length, _, correct = score
        metrics[f"retrieval_ctx{length}"] = round(sum(correct) / len(correct), 4)
        for depth, accuracy in by_depth(score).items():
            metrics[f"retrieval_ctx{length}_depth{depth:g}"] = round(accuracy, 4)
    return metrics


def retrieval_cell(scores: tuple[RetrievalScore, ...], length: int) -> str:
    """`found/asked` at `length`, and by depth: `12/12 (100·100·100)`."""
    score = next((s for s in scores if s[0] == length), None)
    if score is None:
        return "–"
    depths = "·".join(f"{accuracy:.0%}".rstrip("%") for accuracy in by_depth(score).values())
    return f"{sum(score[2])}/{len(score[2])} ({depths})"


def longest_retrieval(rows: list[Any]) -> int | None:
    """The longest length every row answered planted facts at (None: not measured)."""
    lengths = [{length for length, *_ in row.score.retrieval} for row in rows]
    common = set.intersection(*lengths) if lengths else set()
    return max(common) if common else None


def speed_metrics(
    speeds: tuple[LengthSpeed, ...], roofline: tuple[tuple[int, float], ...] = ()
) -> dict[str, float]:
    """MLflow / DVC metrics of speed at long context: `ttft_ms_ctx<L>`, `decode_tok_s_ctx<L>`, `kv_mb_ctx<L>` (where
    the engine says), `peak_rss_mb_ctx<L>` and `roofline_fraction_ctx<L>` (`roofline`: the decode speed after L
    tokens against the memory-bound ceiling of reading the weights and L tokens of KV cache a token)."""
    metrics = {f"roofline_fraction_ctx{length}": round(share, 4) for length, share in roofline}
    for s in speeds:
        metrics |= {
            f"ttft_ms_ctx{s.length}": round(s.ttft_ms, 1),
            f"decode_tok_s_ctx{s.length}": round(s.decode_tok_s, 2),
            **({} if s.kv_bytes is None else {f"kv_mb_ctx{s.length}": round(s.kv_bytes / 1e6, 1)}),
            f"peak_rss_mb_ctx{s.length}": round(s.peak_rss_mb, 1),
        }
    return metrics


def longest_speed(rows: list[Any]) -> int | None:
    """The longest prompt every row's speed was measured at (None: not measured)."""
    lengths = [{s.length for s in row.score.speed_at_length} for row in rows]
    common = set.intersection(*lengths) if lengths else set()
    return max(common) if common else None


def speed_cell(speeds: tuple[LengthSpeed, ...], length: int) -> str:
    """`TTFT s · decode tok/s · KV MB` at `length`."""
    s = next(s for s in speeds if s.length == length)
    kv = "–" if s.kv_bytes is None else f"{s.kv_bytes / 1e6:.0f}"
    return f"{s.ttft_ms / 1000:.1f} · {s.decode_tok_s:.1f} · {kv}"

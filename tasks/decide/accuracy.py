"""The accuracy budget: a variant's perplexity and cloze answers against the baseline's on the same windows and
items (paired bootstrap interval of the perplexity ratio, McNemar's exact test), within `select.max_ppl_increase`
and not significantly worse, or why not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tasks.config import SelectConfig
from tasks.decide.long_context import length_ratios, length_scores, long_context_failures, retrieval_scores
from tasks.decide.statistics import mcnemar_exact, paired_bootstrap_ppl_ratio
from tasks.measure.evaluate import VariantEvaluation


@dataclass(frozen=True)
class AccuracyCheck:
    """A variant's accuracy against the baseline's, on the same windows and cloze items."""

    interval: Any  # the paired bootstrap perplexity ratio (ratio, low, high)
    cloze: Any  # McNemar's exact test on the cloze items
    within_budget: bool
    failure: str | None  # why not, in words


def check_accuracy(
    base: tuple[Sequence[float], Sequence[int], Sequence[bool]],
    variant: tuple[Sequence[float], Sequence[int], Sequence[bool]],
    cfg: SelectConfig,
    is_baseline: bool = False,
) -> AccuracyCheck:
    """The accuracy budget on (window NLLs, window tokens, cloze correct) of the baseline and a variant: the upper
    bound of the paired perplexity-ratio interval within `max_ppl_increase`, cloze not significantly worse."""
    interval = paired_bootstrap_ppl_ratio(
        list(base[0]),
        list(base[1]),
        list(variant[0]),
        list(variant[1]),
        cfg.bootstrap_resamples,
        cfg.confidence,
        cfg.seed,
    )
    cloze = mcnemar_exact(list(base[2]), list(variant[2]))
    significantly_worse = cloze.accuracy_delta < 0 and cloze.p_value < 1 - cfg.confidence
    within_budget = is_baseline or (interval.high <= 1 + cfg.max_ppl_increase and not significantly_worse)
    failure = None if within_budget else _accuracy_failure(interval.high, cloze.p_value, cfg)
    return AccuracyCheck(interval, cloze, within_budget, failure)


def evaluation_accuracy(
    base: VariantEvaluation, variant: VariantEvaluation, cfg: SelectConfig
) -> AccuracyCheck:
    """`check_accuracy` from two evaluations (before anything is benchmarked), with the budget at long context
    where it was measured."""

    def parts(e: VariantEvaluation) -> tuple[list[float], list[int], list[bool]]:
        return e.perplexity.window_nll, e.perplexity.window_tokens, e.cloze.correct

    check = check_accuracy(parts(base), parts(variant), cfg)
    ratios = length_ratios(length_scores(variant), length_scores(base), cfg)
    failures = long_context_failures(ratios, retrieval_scores(variant), retrieval_scores(base), cfg)
    if not failures or not check.within_budget:
        return check
    return replace(check, within_budget=False, failure=failures[0])


def _accuracy_failure(ppl_high: float, cloze_p: float, cfg: SelectConfig) -> str:
    limit = 1 + cfg.max_ppl_increase
    if ppl_high > limit:
        return f"perplexity ratio CI upper bound {ppl_high:.3f} > {limit:.3f}"
    return f"cloze accuracy significantly worse (McNemar p {cloze_p:.3f})"

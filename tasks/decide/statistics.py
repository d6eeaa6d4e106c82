"""Paired statistics for comparing a variant with the baseline on the same evaluation items."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tasks.errors import ComparisonError


@dataclass(frozen=True)
class RatioInterval:
    """Point estimate and percentile bootstrap interval of variant perplexity ÷ baseline perplexity."""

    ratio: float
    low: float
    high: float
    confidence: float


def paired_bootstrap_ppl_ratio(
    base_nll: list[float],
    base_tokens: list[int],
    variant_nll: list[float],
    variant_tokens: list[int],
    resamples: int,
    confidence: float,
    seed: int,
) -> RatioInterval:
    """Resample evaluation windows with replacement, the same windows for both models, and take quantiles.

    Pairing removes the variance the two models share (hard passages are hard for both), so the interval is far
    narrower than comparing two independent perplexities.
    """
    if list(base_tokens) != list(variant_tokens):
        raise ComparisonError(
            "cannot pair perplexities: the variant scored different windows than the baseline"
        )
    base, variant, tokens = (np.asarray(x, dtype=np.float64) for x in (base_nll, variant_nll, base_tokens))
    if len(tokens) == 0:
        raise ComparisonError("cannot compare perplexities: no evaluation windows")
    point = float(np.exp(variant.sum() / tokens.sum() - base.sum() / tokens.sum()))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
    counted = tokens[picks].sum(axis=1)
    log_ratios = (variant[picks].sum(axis=1) - base[picks].sum(axis=1)) / counted
    tail = (1 - confidence) / 2
    low, high = np.exp(np.quantile(log_ratios, [tail, 1 - tail]))
    return RatioInterval(point, float(low), float(high), confidence)


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test on paired correctness: only items where the two models disagree carry information."""

    baseline_only: int  # items the baseline got right and the variant wrong
    variant_only: int
    p_value: float
    accuracy_delta: float


def mcnemar_exact(baseline_correct: list[bool], variant_correct: list[bool]) -> McNemarResult:
    """Two-sided exact binomial test of the discordant pairs (b vs c, p = 0.5)."""
    if len(baseline_correct) != len(variant_correct):
        raise ComparisonError("cannot pair cloze results: the variant answered a different item set")
    b = sum(base and not var for base, var in zip(baseline_correct, variant_correct, strict=True))
    c = sum(var and not base for base, var in zip(baseline_correct, variant_correct, strict=True))
    n = b + c
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n if n else 1.0
    delta = (c - b) / len(baseline_correct) if baseline_correct else 0.0
    return McNemarResult(b, c, min(1.0, 2 * tail), delta)


def paired_speed_ratio(
    champion: list[float], challenger: list[float], resamples: int, confidence: float, seed: int
) -> RatioInterval:
    """Geometric-mean ratio challenger ÷ champion of paired measurements (higher is better for both), with a
    percentile bootstrap interval. Pair i comes from back-to-back runs of the two, so a slow spell of the machine
    hits both sides of a pair."""
    if len(champion) != len(challenger) or not champion:
        raise ComparisonError("cannot pair speeds: the two models were not measured the same number of times")
    logs = np.log(np.asarray(challenger, dtype=np.float64)) - np.log(np.asarray(champion, dtype=np.float64))
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), size=(resamples, len(logs)))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.exp(np.quantile(means, [tail, 1 - tail]))
    return RatioInterval(float(np.exp(logs.mean())), float(low), float(high), confidence)

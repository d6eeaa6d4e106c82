import numpy as np
import pytest

from tasks.decide.statistics import mcnemar_exact, paired_bootstrap_ppl_ratio
from tasks.errors import ComparisonError

TOKENS = [255] * 16


def window_losses(seed: int, mean_nll: float = 3.9) -> list[float]:
    """Per-window summed NLL with realistic spread between passages (some passages are much harder)."""
    rng = np.random.default_rng(seed)
    return list((mean_nll + rng.normal(0, 0.4, len(TOKENS))) * np.asarray(TOKENS))


def ci(base, variant, **kwargs):
    options = {"resamples": 2000, "confidence": 0.95, "seed": 0, **kwargs}
    return paired_bootstrap_ppl_ratio(base, TOKENS, variant, TOKENS, **options)


def test_identical_models_give_a_ratio_of_one_with_a_ci_containing_one():
    base = window_losses(1)
    result = ci(base, base)
    assert result.ratio == pytest.approx(1.0)
    assert result.low <= 1.0 <= result.high


def test_a_planted_five_percent_perplexity_regression_is_detected():
    base = window_losses(2)
    rng = np.random.default_rng(3)
    # +5 % perplexity = +log(1.05) nats per token, with small per-window jitter around it
    shift = (np.log(1.05) + rng.normal(0, 0.005, len(TOKENS))) * np.asarray(TOKENS)
    result = ci(base, list(np.asarray(base) + shift))
    assert result.ratio == pytest.approx(1.05, abs=0.005)
    assert 1.0 < result.low < 1.05 < result.high < 1.1


def test_pure_noise_without_a_shift_keeps_one_inside_the_interval():
    base = window_losses(4)
    rng = np.random.default_rng(5)
    noisy = np.asarray(base) + rng.normal(0, 0.002, len(TOKENS)) * np.asarray(TOKENS)
    result = ci(base, list(noisy))
    assert result.low < 1.0 < result.high


def test_same_seed_same_interval_and_wider_at_higher_confidence():
    base, variant = window_losses(6), window_losses(7)
    assert ci(base, variant) == ci(base, variant)
    narrow, wide = ci(base, variant, confidence=0.8), ci(base, variant, confidence=0.99)
    assert wide.low < narrow.low and narrow.high < wide.high


def test_windows_that_do_not_pair_are_refused():
    with pytest.raises(ComparisonError, match="cannot pair"):
        paired_bootstrap_ppl_ratio([1.0], [10], [1.0], [11], resamples=10, confidence=0.9, seed=0)


def test_mcnemar_matches_the_exact_binomial_tail():
    # 10 discordant pairs, all against the variant: p = 2 * 0.5**10
    result = mcnemar_exact([True] * 10 + [False] * 5, [False] * 10 + [False] * 5)
    assert (result.baseline_only, result.variant_only) == (10, 0)
    assert result.p_value == pytest.approx(2 / 1024)
    assert result.accuracy_delta == pytest.approx(-10 / 15)


def test_mcnemar_of_identical_answers_or_balanced_disagreement_is_one():
    assert mcnemar_exact([True, False], [True, False]).p_value == 1.0
    assert mcnemar_exact([True, False], [False, True]).p_value == 1.0


def test_mcnemar_refuses_unpaired_items():
    with pytest.raises(ComparisonError, match="cannot pair"):
        mcnemar_exact([True], [True, False])

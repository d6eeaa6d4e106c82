"""Speculative decoding's pure parts: prompt lookup, the rejection rule, and the verify loop on a fake engine whose
distributions are known exactly (so sampled output can be tested against them)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from tasks.config import RuntimeSettings, SpeculativeSettings
from tasks.engines.speculative import (
    Greedy,
    NgramProposer,
    Sampling,
    Stats,
    accept_or_resample,
    ngram_proposal,
    speculative_decode,
)
from tasks.params import Config


def test_prompt_lookup_copies_what_followed_the_latest_match_of_the_longest_tail():
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_proposal(context, 3, 3) == [7, 8, 5]  # the latest earlier "1 2 3" was followed by 7 8 5
    assert ngram_proposal(context, 1, 3) == [7]
    assert ngram_proposal([4, 5, 6, 5], 2, 3) == []  # only the 1-gram "5" repeats: chance, not used ...
    assert ngram_proposal([4, 5, 6, 5], 2, 1) == [6, 5]  # ... unless asked for (ngram_size: 1)
    assert ngram_proposal([1, 2, 3, 4], 4, 2) == []  # nothing repeats
    assert ngram_proposal([1], 4, 3) == [] and ngram_proposal([1, 1], 0, 3) == []


def test_the_rejection_rule_emits_the_targets_distribution_whatever_the_proposals():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.1, 0.4, 0.4])  # a proposer that is mostly wrong
    draws = 20_000
    emitted = np.zeros(4)
    for _ in range(draws):
        _, token = accept_or_resample(p, int(rng.choice(4, p=q)), rng, q)
        emitted[token] += 1
    assert chisquare(emitted, p * draws).pvalue > 1e-3
    emitted[:] = 0  # a deterministic proposer (q one-hot on its guess)
    for _ in range(draws):
        _, token = accept_or_resample(p, 2, rng)
        emitted[token] += 1
    assert chisquare(emitted, p * draws).pvalue > 1e-3
    # the test can tell: keeping every proposal (no rule) emits q, far from p
    assert chisquare(np.bincount(rng.choice(4, size=draws, p=q), minlength=4), p * draws).pvalue < 1e-6


class MarkovEngine:
    """A fake engine whose next-token logits depend on the last token only; it records the tokens its cache holds
    (the tests compare them with the output) and refuses a rewind past its end."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits, self.held, self.calls = logits, [], 0

    def extend(self, tokens: list[int], every: bool = True) -> np.ndarray:
        self.held += tokens
        self.calls += 1
        return self.logits[self.held[-len(tokens) :] if every else self.held[-1:]]

    def rewind(self, length: int) -> None:
        assert length <= len(self.held)
        self.held = self.held[:length]


class FixedGuesses:
    def __init__(self, guesses: list[int]) -> None:
        self.guesses = guesses

    def reset(self, capacity: int) -> None:
        return None

    def propose(self, context: list[int], limit: int) -> list[int]:
        return self.guesses[:limit]


LOGITS = np.log(np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.25, 0.25, 0.5]]))


def test_sampled_speculative_output_has_the_targets_joint_distribution():
    """Three tokens after [0], 6000 times, with guesses that are right a third of the time: the 27 sequences'
    frequencies match the chain's exact probabilities (chi-square), and the cache always held the output."""
    rng = np.random.default_rng(1)
    probabilities = np.exp(LOGITS)
    counts: dict[tuple[int, ...], int] = {}
    stats = Stats()
    for _ in range(6000):
        engine = MarkovEngine(LOGITS)
        out = speculative_decode(engine, FixedGuesses([1, 2]), [0], 3, 2, Sampling(rng=rng), stats=stats)
        assert engine.held[: 1 + len(out) - 1] == [0, *out[:-1]]  # what it verified is what it emitted
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    sequences = list(itertools.product(range(3), repeat=3))
    expected = [
        probabilities[0, a] * probabilities[a, b] * probabilities[b, c] * 6000 for a, b, c in sequences
    ]
    observed = [counts.get(s, 0) for s in sequences]
    assert chisquare(observed, expected).pvalue > 1e-3
    assert 0 < stats.accepted < stats.proposed  # guesses were both kept and refused


@pytest.mark.parametrize("guesses", [[1, 0, 1, 0], [2, 2, 2, 2], []])
def test_greedy_speculative_output_is_the_greedy_output_and_stops_at_eos(guesses):
    engine = MarkovEngine(LOGITS)
    plain = [1, 0, 1, 0, 1, 0, 1]  # greedy chain from 0: argmax 1, then 0, then 1 ...
    assert speculative_decode(engine, FixedGuesses(guesses), [0], 7, 4, Greedy()) == plain
    # the cache holds the prompt and the output but the last token, never a refused guess
    assert engine.held in ([0, *plain[:-1]], [0, *plain])
    barred = speculative_decode(
        MarkovEngine(LOGITS), FixedGuesses(guesses), [0], 5, 4, Greedy(frozenset({1}))
    )
    assert barred == [2, 2, 2, 2, 2]  # 1 barred (runs to length): 0 → 2 → 2 ...
    assert speculative_decode(MarkovEngine(LOGITS), FixedGuesses(guesses), [2], 9, 4, Greedy(), eos=0) == [
        2,
        2,
        2,
        2,
        2,
        2,
        2,
        2,
        2,
    ]
    assert speculative_decode(MarkovEngine(LOGITS), FixedGuesses(guesses), [1], 9, 4, Greedy(), eos=1) == [
        0,
        1,
    ]


def test_ngram_proposals_cut_calls_when_the_text_repeats():
    engine, stats = MarkovEngine(LOGITS), Stats()
    out = speculative_decode(engine, NgramProposer(2), [0, 1, 0, 1, 0], 16, 4, Greedy(), stats=stats)
    assert out == [1, 0] * 8
    # lookup copies what followed the match, up to the context's end: two guesses a call here, all kept
    assert stats.tokens_per_call == 3 and engine.calls == 6  # vs 16 calls one token at a time


def test_speculative_settings_are_checked_where_they_are_written():
    with pytest.raises(ValueError, match="needs `draft"):
        SpeculativeSettings(method="draft")
    with pytest.raises(ValueError, match="ngram proposes from the text"):
        SpeculativeSettings(method="ngram", draft="x")
    with pytest.raises(ValueError, match="kv_cache: static"):
        RuntimeSettings.model_validate({"kv_cache": "static", "speculative": {"method": "ngram"}})
    variants = {"baseline": {}, "fast": {"runtime": {"speculative": {"method": "draft", "draft": "nope"}}}}
    with pytest.raises(ValueError, match="'nope', which is not another variant"):
        Config.model_validate({"variants": variants})
    variants["nope"] = {"runtime": {"speculative": {"method": "ngram"}}}
    with pytest.raises(ValueError, match="speculates itself"):
        Config.model_validate({"variants": variants})
    onnx = {"steps": [{"onnx_genai": {"precision": "int4"}}], "runtime": {"speculative": {"method": "ngram"}}}
    Config.model_validate({"variants": {"baseline": {}, "onnx": onnx}})  # every engine verifies


def test_a_variant_without_speculation_keeps_its_build_identity():
    assert "speculative" not in RuntimeSettings().identity()

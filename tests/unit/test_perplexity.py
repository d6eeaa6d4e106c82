import math

import pytest

from tasks.config import EvaluateConfig
from tasks.measure.evaluate import (
    cloze_accuracy,
    cloze_items,
    evaluate_perplexity,
    greedy_agreement,
    make_windows,
    perplexity_from_losses,
)


def test_windows_are_non_overlapping_and_capped():
    assert make_windows(list(range(10)), window=4, max_tokens=9) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert make_windows(list(range(10)), window=4, max_tokens=10) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_perplexity_is_exp_of_token_weighted_mean_nll():
    assert perplexity_from_losses([2.0, 4.0], [1, 3]) == pytest.approx(math.exp(6.0 / 4))
    with pytest.raises(ValueError):
        perplexity_from_losses([], [])


class ConstantLossRuntime:
    """Every predicted token costs log(7) nats: perplexity must come out as exactly 7."""

    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def score(self, sequences):
        return [(math.log(7) * (len(ids) - 1), len(ids) - 1) for ids in sequences]


def test_evaluate_counts_every_window_and_reports_progress():
    seen = []
    result = evaluate_perplexity(
        ConstantLossRuntime(),
        ["w " * 50],
        EvaluateConfig(window=16, max_tokens=40),
        lambda d, t: seen.append((d, t)),
    )
    assert result.perplexity == pytest.approx(7.0)
    assert result.window_tokens == [15, 15, 7]
    assert seen[-1] == (3, 3)


def test_agreement_counts_matching_positions_and_whole_matches():
    result = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert result.token_agreement == pytest.approx(7 / 8)
    assert result.exact_match == pytest.approx(0.5)
    assert result.prompts == 2


def test_agreement_of_a_shorter_continuation_counts_missing_tokens_as_mismatches():
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 2]]).token_agreement == pytest.approx(0.5)


def test_agreement_needs_the_same_prompts():
    with pytest.raises(ValueError, match="same, non-empty"):
        greedy_agreement([[1]], [])


def test_cloze_items_take_sentence_final_words_with_preceding_context():
    text = "one two three four five six seven eight nine ten. Alpha beta gamma delta epsilon zeta eta theta iota kappa!"
    items = cloze_items([text], count=10, context_words=3)
    assert [(i.context, i.target) for i in items] == [
        ("seven eight nine", "ten"),
        ("eta theta iota", "kappa"),
    ]
    assert len(cloze_items([text], count=1, context_words=3)) == 1


class EchoRuntime:
    """Continues every prompt with a fixed word: correct exactly where that word is the target."""

    def encode(self, text):
        return [len(text)]

    def decode(self, ids):
        return " Kappa, and more"

    def generate(self, prompts, max_new_tokens, stop_at_eos=True):
        return [[0] for _ in prompts]


def test_cloze_accuracy_compares_the_first_generated_word_case_insensitively():
    text = "one two three four five six seven eight nine ten. Alpha beta gamma delta epsilon zeta eta theta iota kappa!"
    result = cloze_accuracy(EchoRuntime(), cloze_items([text], 10, 3), max_new_tokens=4)
    assert result.correct == [False, True]
    assert result.accuracy == 0.5


def test_next_token_nll_is_the_float64_log_softmax_of_each_next_token():
    import numpy as np

    from tasks.engines.contract import next_token_nll

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 50)) * 30).astype(np.float16)  # large logits: the max shift matters
    ids = [3, 7, 0, 49, 12, 5]
    rows = logits.astype(np.float64)
    expected = sum(
        np.log(np.exp(rows[i] - rows[i].max()).sum()) + rows[i].max() - rows[i, ids[i + 1]] for i in range(5)
    )
    total, count = next_token_nll(logits, ids)
    assert count == 5 and total == pytest.approx(expected, rel=1e-12)
    assert next_token_nll(logits, ids[:1]) == (0.0, 0)


def test_next_token_nll_runs_on_one_torch_thread_and_leaves_the_setting_as_it_was(monkeypatch):
    """The engines that call it are not torch's: torch's thread pool, once run in a process, made llama.cpp decode
    2.5x slower there for the rest of its life (docs/search.md). The log-softmax sees one thread; the caller's
    setting is back afterwards, also when the computation fails."""
    import numpy as np
    import torch

    from tasks.engines.contract import next_token_nll

    seen = []
    original = torch.log_softmax
    monkeypatch.setattr(
        torch, "log_softmax", lambda *a, **k: seen.append(torch.get_num_threads()) or original(*a, **k)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        next_token_nll(np.zeros((4, 10), dtype=np.float32), [1, 2, 3, 4])
        assert seen == [1] and torch.get_num_threads() == 2
        with pytest.raises((IndexError, RuntimeError)):
            next_token_nll(np.zeros((4, 10), dtype=np.float32), [1, 2, 3, 40])  # an id past the vocabulary
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

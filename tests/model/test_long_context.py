"""Accuracy at long context through every engine: the tail's negative log-likelihood fed through the engine's
incremental sequence in slices equals the direct computation from one forward pass's logits; every length's window
ends with the same tail; documents or lengths the model cannot hold are named."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.config import LongContextConfig, TargetConfig
from tasks.engines import load_runtime
from tasks.errors import DataValidationError
from tasks.measure import long_context
from tasks.measure.evaluate import VariantEvaluation, evaluate_long_context, load_evaluation, save_evaluation
from tests.factories import TINY_ENGINE_RECIPES, synthetic_sentences

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module", params=sorted(TINY_ENGINE_RECIPES))
def runtime(request, tiny_engine_dir):
    return load_runtime(tiny_engine_dir(request.param), TargetConfig(threads=1))


def _direct_tail_nll(runtime, window: list[int], tail: int) -> float:
    """From the logits of one forward pass over the whole window: the log-softmax at the rows predicting the tail."""
    logits = np.asarray(runtime.position_logits(window), dtype=np.float64)[-tail - 1 : -1]
    targets = np.asarray(window[-tail:])
    log_norm = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return float((log_norm - logits[np.arange(tail), targets]).sum())


def test_the_tail_fed_after_sliced_context_scores_as_one_forward_pass(runtime, monkeypatch):
    monkeypatch.setattr(
        long_context, "SLICE_TOKENS", 37
    )  # the context in several calls, the last one partial
    ids = runtime.encode(" ".join(synthetic_sentences(80, seed=3)))
    window = ids[:300]
    nll, count = long_context.tail_nll(runtime, window, 40)
    assert count == 40
    assert nll == pytest.approx(_direct_tail_nll(runtime, window, 40), rel=1e-4)
    # one slice of context, or none but the token before the tail: still the direct computation of that window
    for shorter in (window[-100:], window[-41:]):
        assert long_context.tail_nll(runtime, shorter, 40)[0] == pytest.approx(
            _direct_tail_nll(runtime, shorter, 40), rel=1e-4
        )


def test_every_length_scores_the_same_tail_per_document_and_pairs_like_the_short_windows(runtime, tmp_path):
    cfg = LongContextConfig(documents=2, lengths=[96, 192, 384], tail_tokens=64)
    documents = [(f"doc{seed}", " ".join(synthetic_sentences(80, seed=seed))) for seed in (1, 2)]
    ids = runtime.encode(documents[0][1])
    windows = long_context.tail_windows(ids, cfg)
    assert [len(windows[length]) for length in cfg.lengths] == cfg.lengths
    assert all(windows[length][-64:] == ids[384 - 64 : 384] for length in cfg.lengths)
    results = evaluate_long_context(runtime, (cfg, documents))
    assert list(results) == ["96", "192", "384"]
    for length, result in results.items():
        assert result.window_tokens == [64, 64] and result.predicted_tokens == 128
        direct = [
            _direct_tail_nll(runtime, long_context.tail_windows(runtime.encode(t), cfg)[int(length)], 64)
            for _, t in documents
        ]
        assert result.window_nll == pytest.approx(direct, rel=1e-4)
        assert result.perplexity == pytest.approx(np.exp(sum(direct) / 128), rel=1e-4)
    # kept with the evaluation and read back as it was
    from tasks.measure.evaluate import AgreementResult, ClozeResult

    evaluation = VariantEvaluation(
        results["96"], AgreementResult(1.0, 1.0, 1), [[1]], ClozeResult(1.0, [True]), {}, results
    )
    save_evaluation(tmp_path / "e.json", "key", evaluation)
    assert load_evaluation(tmp_path / "e.json", "key") == evaluation


def test_a_document_or_a_length_the_model_cannot_hold_is_named(runtime):
    short = [
        ("long", " ".join(synthetic_sentences(80, seed=1))),
        ("psalm 117", "O praise the LORD, all ye nations"),
    ]
    with pytest.raises(DataValidationError, match=r"document 'psalm 117' has \d+ tokens, under 128"):
        evaluate_long_context(runtime, (LongContextConfig(lengths=[128], tail_tokens=64), short))
    too_long = LongContextConfig(lengths=[runtime.context_length + 1], tail_tokens=64)
    with pytest.raises(DataValidationError, match=rf"{runtime.context_length + 1} tokens, the model takes"):
        evaluate_long_context(runtime, (too_long, short[:1]))


def test_speed_at_length_reports_each_window_and_a_kv_cache_holding_it(runtime):
    ids = runtime.encode(" ".join(synthetic_sentences(40, seed=5)))
    peaks, resets = iter([100.0, 120.0]), []
    speeds = long_context.speed_at_lengths(
        runtime, ids, [512, 128], lambda: next(peaks), lambda: resets.append(1)
    )
    assert [s.length for s in speeds] == [128, 512] and [s.peak_rss_mb for s in speeds] == [100.0, 120.0]
    assert len(resets) == 2 and all(s.ttft_ms > 0 and s.decode_tok_s > 0 for s in speeds)
    # keys and values of every layer per token: the tiny model's 2 layers × 2 heads × 16 wide × 2, in 4 bytes (fp32)
    # or 2 (llama.cpp's f16 cache); a window of the model's 512 positions holds its decoded tokens too
    for s in speeds:
        assert 128 * 2 * (s.length - 1) <= s.kv_bytes <= 128 * 4 * s.length * 1.02, s
    with pytest.raises(DataValidationError, match="long_prompt_tokens: 1024 tokens, the model takes 512"):
        long_context.speed_at_lengths(runtime, ids, [1024], lambda: 0.0)

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


def test_served_capacity_by_length_counts_the_largest_burst_meeting_the_slo_and_stops_at_a_miss(runtime):
    from dataclasses import replace

    from serving.models import Limits
    from tasks.config import LoadtestConfig, SloConfig
    from tasks.measure.served import ServedPlan, length_requests
    from tasks.measure.served_lengths import capacity_by_length, capacity_metrics

    documents = [" ".join(synthetic_sentences(60, seed=seed)) for seed in (1, 2)]
    mix = LoadtestConfig(max_tokens=[4, 8], seed=3)
    lengths = tuple((n, tuple(length_requests(documents, n, 2, mix, 64))) for n in (128, 256))
    for length, requests in lengths:  # prompt + answer fill the window; seeded, so every variant gets them
        assert all(r.tokens + r.max_tokens == length and 4 <= r.max_tokens <= 8 for r in requests)
        assert len({r.prompt for r in requests}) == 2
        assert requests == tuple(length_requests(documents, length, 2, mix, 64))
    limits = Limits(max_batch=4, max_queue=4, step_tokens=64)
    plan = ServedPlan((), limits, SloConfig(ttft_p95_ms=600_000), lengths, (1, 2))
    peaks = iter(range(100, 200))
    generous = capacity_by_length(runtime, plan, lambda: float(next(peaks)))
    assert [(c.length, c.clients, [lvl.concurrency for lvl in c.levels]) for c in generous] == [
        (128, 2, [1, 2]),
        (256, 2, [1, 2]),
    ]
    assert all(lvl.errors == 0 and lvl.tok_s > 0 for c in generous for lvl in c.levels)
    # every request ran to its budget: the tokens of a burst are its requests' budgets
    first = generous[0].levels[1]
    assert first.tok_s * first.wall_s == pytest.approx(sum(r.max_tokens for r in lengths[0][1]))
    metrics = capacity_metrics(generous)
    assert metrics["served_clients_ctx256"] == 2 and metrics["served_peak_rss_mb_ctx128_c1"] == 100.0
    # an SLO nobody meets: the shortest length's single request misses, the longer length is not served at all
    missed = capacity_by_length(runtime, replace(plan, slo=SloConfig(ttft_p95_ms=1e-6)))
    assert [(c.clients, len(c.levels)) for c in missed] == [(0, 1), (0, 0)]
    assert capacity_metrics(missed)["served_clients_ctx256"] == 0
    with pytest.raises(DataValidationError, match="no long document has 100000 words"):
        length_requests(documents, 100_000, 1, mix, 64)
    # a length whose single request took longer to its first token than the SLO allows, alone: not served at all
    skipped = capacity_by_length(
        runtime, replace(plan, slo=SloConfig(ttft_p95_ms=600_000)), alone_ttft_ms={256: 700_000.0}
    )
    assert [len(c.levels) for c in skipped] == [2, 0] and skipped[1].clients == 0


def test_serve_sequence_tokens_sizes_one_requests_room_in_every_engine(runtime):
    from serving.models import Limits

    for room in (256, None):
        scheduler = Limits(max_batch=2, max_queue=2, step_tokens=64, sequence_tokens=room).scheduler(runtime)
        try:
            decoder = scheduler._decoder()
            if room is not None:  # the request's room, and the stream llama.cpp sizes for each row
                assert decoder.sequence_tokens == scheduler.request_tokens == 256
                if type(decoder).__name__.startswith("LlamaCpp"):
                    decoder.reserve(2)
                    assert decoder._context.cells == 2 * 256
                    with pytest.raises(
                        ValueError, match="a prompt of 300 tokens does not fit a stream of 256"
                    ):
                        decoder.open(list(range(300)))
            elif type(decoder).__name__.startswith(
                "LlamaCpp"
            ):  # 2 048 cells, or the model's context if smaller
                assert decoder.sequence_tokens == scheduler.request_tokens == runtime.context_length
            else:  # the cache grows: the model's context
                assert scheduler.request_tokens is None
        finally:
            scheduler.close()

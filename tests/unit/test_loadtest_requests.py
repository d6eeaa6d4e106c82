"""The load test's request set: fixed by its seed, varied in prompt length and budget, capped by the server."""

from serving.loadtest import Outcome, request_set, summarize
from tasks.config import LoadtestConfig

PASSAGES = [" ".join(f"w{d}_{i}" for i in range(300)) for d in range(5)]


def test_the_same_seed_gives_the_same_requests_and_lengths_and_budgets_vary():
    cfg = LoadtestConfig(requests_per_level=40, prompt_words=[8, 160], max_tokens=[16, 64])
    requests = request_set(PASSAGES, cfg, server_cap=256)
    assert requests == request_set(PASSAGES, cfg, server_cap=256)
    assert requests != request_set(PASSAGES, cfg.model_copy(update={"seed": 1}), server_cap=256)
    lengths = {len(r.prompt.split()) for r in requests}
    budgets = {r.max_tokens for r in requests}
    assert min(lengths) >= 8 and max(lengths) <= 160 and len(lengths) > 10
    assert min(budgets) >= 16 and max(budgets) <= 64 and len(budgets) > 10


def test_budgets_are_capped_by_the_server():
    cfg = LoadtestConfig(requests_per_level=20, max_tokens=[16, 64])
    assert {r.max_tokens for r in request_set(PASSAGES, cfg, server_cap=20)} <= set(range(16, 21))


def test_summary_counts_only_answered_requests_in_rates_and_percentiles():
    outcomes = [Outcome(200, 0.1, 1.0, 10), Outcome(200, 0.3, 2.0, 30), Outcome(429, float("nan"), 0.01, 0)]
    result = summarize(4, outcomes, wall_s=2.0, engine={"decoded": 36.0, "decode_s": 0.5, "prefill_s": 1.0})
    assert result.errors == 1 and result.requests == 3
    assert result.tok_s == 20.0 and result.requests_s == 1.0
    assert result.ttft_p50_ms == 200.0 and result.e2e_p95_ms == 1950.0
    assert result.decode_tok_s == 72.0 and result.prefill_share == 0.5

"""The load test's request set: fixed by its seed, varied in prompt length and budget, capped by the server."""

from tasks.config import LoadtestConfig
from tasks.measure.served import Outcome, request_set, summarize

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


def test_time_per_output_token_inter_token_gaps_and_goodput_against_an_slo():
    from tasks.config import SloConfig

    fast = Outcome(200, 0.1, 0.5, 5, (0.1, 0.2, 0.3, 0.4, 0.5))  # TPOT 100 ms
    slow = Outcome(200, 0.2, 2.2, 5, (0.2, 0.7, 1.2, 1.7, 2.2))  # TPOT 500 ms
    assert fast.tpot_s == 0.1 and slow.tpot_s == 0.5
    slo = SloConfig(ttft_p95_ms=300, tpot_p95_ms=200)
    assert fast.meets(slo) and not slow.meets(slo) and not Outcome(429, float("nan"), 0.0, 0).meets(slo)
    result = summarize(0, [fast, slow], wall_s=4.0, rate=0.5, slo=slo)
    assert result.load == "0.5 req/s" and result.goodput_rps == 0.25
    assert result.tpot_p50_ms == 300.0 and result.itl_p50_ms == 300.0  # gaps: four of 100 ms, four of 500 ms
    assert not result.meets(slo) and summarize(0, [fast], 1.0, rate=0.5, slo=slo).meets(slo)


def test_the_rate_search_doubles_until_missed_then_bisects(monkeypatch):
    from serving import loadtest
    from tasks.config import SloConfig

    capacity = 3.0  # a server that meets the SLO below 3 req/s
    tried = []

    def measured(url, drive, concurrency, rate, slo):
        tried.append(rate)
        ttft = 0.1 if rate < capacity else 5.0
        return summarize(0, [Outcome(200, ttft, ttft + 0.4, 5, ())], 1.0, rate=rate, slo=slo)

    monkeypatch.setattr(loadtest, "_measured", measured)
    best, trials = loadtest.search_rate("u", None, [], None, SloConfig(ttft_p95_ms=1000), 1.0, 5)
    assert tried == [1.0, 2.0, 4.0, 3.0, 2.5] and best.rate_rps == 2.5 and len(trials) == 5
    none_met, _ = loadtest.search_rate("u", None, [], None, SloConfig(ttft_p95_ms=1000), 8.0, 2)
    assert none_met is None and tried[-2:] == [8.0, 4.0]


def test_the_rate_mode_sends_every_request_and_reads_its_streamed_chunks():
    import asyncio

    import httpx
    import pytest

    from serving.loadtest import LoadRequest, run_rate

    stream = 'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'
    usage = 'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=stream + usage))
    original = httpx.AsyncClient.__init__

    def with_transport(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "transport": transport})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx.AsyncClient, "__init__", with_transport)
        outcomes, _ = asyncio.run(run_rate("http://x", None, [LoadRequest("p", 4)] * 12, 500.0, None, seed=0))
    assert len(outcomes) == 12 and all(o.status == 200 and o.tokens == 2 for o in outcomes)
    assert all(len(o.token_times) == 2 and o.token_times[0] <= o.token_times[1] for o in outcomes)


def test_a_served_rate_above_the_offline_replay_is_called_suspect_not_a_share():
    from flows.cli.render import print_load_test
    from flows.cli.session import console
    from serving.loadtest import LevelResult

    def level(clients: int, tok_s: float) -> LevelResult:
        return LevelResult(clients, 48, 0, 10.0, 4.8, tok_s, 300, 900, 2000, 4000, tok_s, 0.1)

    with console.capture() as captured:
        print_load_test([level(1, 80), level(16, 240)], None, same_mix={1: 81.0, 16: 183.0})
    lines = " ".join(captured.get().split())  # the console wraps at its width
    assert "80 tok/s, 99% of it" in lines  # below the replay: a share
    assert "240 tok/s, above it (131%): no ceiling" in lines and "131% of it" not in lines

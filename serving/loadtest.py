"""`llmopt loadtest`: drive a running server with a fixed, seeded set of requests (prompts of varied length, varied
max_tokens, greedy, streamed) at several concurrency levels (closed loop: each client sends its next request when
one ends) and at request rates (open loop: Poisson arrivals, as real traffic comes), and report what its clients
get: requests/s, aggregate generated tok/s, time to first token, time per output token, inter-token latency and
end-to-end percentiles; with an SLO, goodput (requests/s that met it) and a search for the highest rate that
meets it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from typing import Any

import httpx
import numpy as np

from serving.models import Limits
from tasks.config import SloConfig
from tasks.measure.served import LevelResult, LoadRequest, Outcome, replay, summarize


async def _one(
    client: httpx.AsyncClient, model: str | None, request: LoadRequest, ignore_eos: bool = False
) -> Outcome:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if (
        ignore_eos
    ):  # every answer runs to max_tokens, the same work on every server (vLLM's and llama.cpp's field)
        body["ignore_eos"] = True
    started, first, tokens, times = time.perf_counter(), float("nan"), 0, []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(response.status_code, first, time.perf_counter() - started, 0)
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:  # failed after the stream began (e.g. its timeout): not an answer
                    return Outcome(
                        chunk["error"].get("code", 500), first, time.perf_counter() - started, tokens
                    )
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    times.append(time.perf_counter() - started)
                if chunk.get("choices") and first != first:  # nan: the first chunk carrying a token
                    first = time.perf_counter() - started
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    except httpx.HTTPError:  # a dropped connection counts as a failed request, not the end of the test
        return Outcome(0, first, time.perf_counter() - started, 0)
    return Outcome(200, first, time.perf_counter() - started, tokens, tuple(times))


async def run_level(
    url: str,
    model: str | None,
    requests: list[LoadRequest],
    concurrency: int,
    api_key: str | None,
    ignore_eos: bool = False,
    keep_alive: bool = True,
) -> tuple[list[Outcome], float]:
    """Send `requests` with at most `concurrency` in flight (each client sends its next as soon as one ends).
    `keep_alive` off: a connection per request (llama-server closes reused ones after a few requests)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pending = list(reversed(requests))
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=None if keep_alive else 0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while pending:
                outcomes.append(await _one(client, model, pending.pop(), ignore_eos))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - started


async def run_rate(
    url: str, model: str | None, requests: list[LoadRequest], rate: float, api_key: str | None, seed: int
) -> tuple[list[Outcome], float]:
    """Send `requests` at Poisson arrivals of `rate` per second (seeded), however many are in flight: an open
    loop, so a server slower than the rate shows as growing latency, not as fewer requests."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(requests)))
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        started, sent = time.perf_counter(), []
        for request, at in zip(requests, arrivals, strict=True):
            await asyncio.sleep(max(0.0, started + float(at) - time.perf_counter()))
            sent.append(asyncio.create_task(_one(client, model, request)))
        outcomes = list(await asyncio.gather(*sent))
        return outcomes, time.perf_counter() - started


def engine_counters(url: str) -> dict[str, float]:
    """The server's cumulative engine counters from /metrics: decoded tokens and seconds per phase."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {"decoded": 0.0, "decode_s": 0.0, "prefill_s": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "llmopt_batch_size_sum":
                counters["decoded"] += sample.value
            elif sample.name == "llmopt_engine_seconds_total":
                counters[f"{sample.labels['phase']}_s"] += sample.value
    return counters


def load_test(
    url: str,
    model: str | None,
    requests: list[LoadRequest],
    levels: list[int],
    api_key: str | None,
    rates: list[float] = (),
    slo: SloConfig | None = None,
    seed: int = 0,
) -> list[LevelResult]:
    """Every concurrency level, then every request rate, in turn, after one warm-up request (the server's first
    request pays for allocations)."""
    asyncio.run(run_level(url, model, requests[:1], 1, api_key))
    results = []
    for concurrency in levels:
        results.append(
            _measured(
                url, lambda c=concurrency: run_level(url, model, requests, c, api_key), concurrency, slo=slo
            )
        )
    for rate in rates:
        results.append(
            _measured(url, lambda r=rate: run_rate(url, model, requests, r, api_key, seed), 0, rate, slo)
        )
    return results


def _measured(
    url: str, drive: Any, concurrency: int, rate: float = float("nan"), slo: SloConfig | None = None
) -> LevelResult:
    before = engine_counters(url)
    outcomes, wall = asyncio.run(drive())
    after = engine_counters(url)
    engine = {key: after[key] - before[key] for key in after}
    return summarize(concurrency, outcomes, wall, engine, rate, slo)


def search_rate(
    url: str,
    model: str | None,
    requests: list[LoadRequest],
    api_key: str | None,
    slo: SloConfig,
    start_rps: float,
    trials: int,
    seed: int = 0,
    report: Any = None,
) -> tuple[LevelResult | None, list[LevelResult]]:
    """The highest request rate whose p95 TTFT and TPOT meet `slo` with no errors: the rate doubles from
    `start_rps` until a trial misses, then halves the gap between the best rate that met it and the lowest that
    did not, for `trials` trials in all. Returns (the best trial or None if even the lowest missed, every trial)."""
    met: LevelResult | None = None
    missed: float | None = None
    rate, tried = start_rps, []
    for _ in range(trials):
        result = _measured(url, lambda r=rate: run_rate(url, model, requests, r, api_key, seed), 0, rate, slo)
        tried.append(result)
        if report:
            report(result, result.meets(slo))
        if result.meets(slo):
            met = result if met is None or rate > met.rate_rps else met
        else:
            missed = rate if missed is None else min(missed, rate)
        low = met.rate_rps if met else 0.0
        rate = rate * 2 if missed is None else (low + missed) / 2 if met else rate / 2
    return met, tried


def offline_same_mix(runtime: Any, requests: list[LoadRequest], clients: int, limits: Limits) -> float:
    """Generated tok/s of the same request set run through the same engine and scheduler settings in this
    process (`replay`: no HTTP or client in between; greedy, stopping at the end-of-sequence token as served
    requests do): the ceiling the served figures are read against. Its decoder is warmed before the clock starts
    (the server's was, by the load test's warm-up request: timing that setup made the replay read 183 tok/s where
    the server delivered 240)."""
    outcomes, wall = replay(runtime, requests, clients, limits)
    return sum(o.tokens for o in outcomes if o.status == 200) / wall


def served_model(url: str, model: str | None, api_key: str | None) -> dict:
    """What the server says it serves (its /health entry for `model`, or its default); a clear error when no
    server answers at `url`."""
    from tasks.errors import ServiceError

    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ServiceError(
            f"no llmopt server answers at {url} ({exc}); start one with `llmopt serve`"
        ) from None
    entries = health.get("models", [])
    for entry in entries:
        if model is None or model in (entry["id"], entry["id"].split("@")[-1]):
            return entry
    names = ", ".join(entry["id"] for entry in entries)
    raise ServiceError(f"the server at {url} does not serve {model!r}; it serves: {names}")


def offline_ceiling(registered: str, version: str) -> tuple[int, float] | None:
    """(batch size, decode tok/s) of the largest batch the pipeline's benchmark measured for this version: the
    engine's own throughput without a server, the reference a server's aggregate rate is read against."""
    from tasks.decide.model_registry import version_run_metrics

    batches = [
        (int(k.removeprefix("decode_tok_s_bs")), v)
        for k, v in version_run_metrics(registered, version).items()
        if k.startswith("decode_tok_s_bs")
    ]
    return max(batches) if batches else None


def log_load_test(
    experiment: str,
    entry: dict,
    results: list[LevelResult],
    ceiling: tuple[int, float] | None,
    settings: dict,
    best: LevelResult | None = None,
    searched: tuple[LevelResult, ...] | list[LevelResult] = (),
    same_mix: dict[int, float] | None = None,
) -> str:
    """One MLflow run per load test, tagged with the model version it drove; the version gets a tag pointing
    back at it. Returns the run id."""
    from tasks.decide.model_registry import tag_version
    from tasks.report.tracking import log_standalone_run

    registered, _, version = entry["served_id"].rpartition("/")
    trial = {id(result): number for number, result in enumerate(searched, 1)}
    metrics: dict[str, float] = {}
    for result in results:
        fields = asdict(result)
        concurrency, rate = fields.pop("concurrency"), fields.pop("rate_rps")
        prefix = f"r{rate:g}" if rate == rate else f"c{concurrency}"
        if id(result) in trial:  # the SLO search's trials: keys of their own, beside the rates asked for
            prefix = f"s{trial[id(result)]}"
            metrics[f"{prefix}.rate_rps"] = rate
        metrics |= {f"{prefix}.{k}": float(v) for k, v in fields.items()}
    if ceiling:
        metrics[f"offline_decode_tok_s_bs{ceiling[0]}"] = ceiling[1]
    for clients, tok_s in (same_mix or {}).items():
        metrics[f"offline_same_mix.c{clients}.tok_s"] = tok_s
    if best is not None:
        metrics |= {"slo.max_rate_rps": best.rate_rps, "slo.goodput_rps": best.goodput_rps}
    tags = {
        "llmopt.kind": "loadtest",
        "llmopt.model": registered,
        "llmopt.model_version": version,
        "llmopt.variant": entry["variant"],
        "llmopt.engine": entry["engine"],
    }
    run_id = log_standalone_run(experiment, f"loadtest {entry['served_id']}", tags, settings, metrics)
    tag_version(registered, version, "llmopt.loadtest_run", run_id)
    return run_id

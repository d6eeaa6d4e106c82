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
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from serving.scheduler import DEFAULT_STEP_TOKENS
from tasks.config import LoadtestConfig, SloConfig


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Outcome:
    status: int
    ttft_s: float  # until the first streamed token (nan when none came)
    total_s: float
    tokens: int
    token_times: tuple[float, ...] = ()  # when each chunk carrying text arrived, from the request's start

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (nan with fewer than two tokens)."""
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else float("nan")

    def meets(self, slo: SloConfig | None) -> bool:
        """Answered, and within the SLO's time to first token and time per output token (each where set)."""
        if self.status != 200 or slo is None:
            return self.status == 200
        ttft_ok = slo.ttft_p95_ms is None or self.ttft_s * 1000 <= slo.ttft_p95_ms
        tpot_ok = slo.tpot_p95_ms is None or not self.tpot_s * 1000 > slo.tpot_p95_ms  # nan (one token) meets
        return ttft_ok and tpot_ok


@dataclass(frozen=True)
class LevelResult:
    concurrency: int  # clients (closed loop); 0 in rate mode
    requests: int
    errors: int
    wall_s: float
    requests_s: float
    tok_s: float  # generated tokens of all requests per wall-clock second
    ttft_p50_ms: float
    ttft_p95_ms: float
    e2e_p50_ms: float
    e2e_p95_ms: float
    decode_tok_s: float  # the server's decode phase alone: tokens from batched steps per second inside them
    prefill_share: float  # of the wall time, the part the engine spent running prompts (a step waits for it)
    rate_rps: float = float("nan")  # the offered request rate (rate mode); nan for concurrency levels
    tpot_p50_ms: float = float("nan")  # time per output token after the first, per request
    tpot_p95_ms: float = float("nan")
    itl_p50_ms: float = float("nan")  # gaps between successive streamed chunks, over all requests
    itl_p95_ms: float = float("nan")
    goodput_rps: float = float("nan")  # requests/s that met the SLO (nan: no SLO set)

    @property
    def load(self) -> str:
        if self.rate_rps == self.rate_rps:
            return f"{self.rate_rps:.3g} req/s"
        return f"{self.concurrency} client{'s' if self.concurrency != 1 else ''}"

    def meets(self, slo: SloConfig) -> bool:
        """No errors, and p95 time to first token and time per output token within the SLO."""
        ttft = slo.ttft_p95_ms is None or self.ttft_p95_ms <= slo.ttft_p95_ms
        tpot = slo.tpot_p95_ms is None or not self.tpot_p95_ms > slo.tpot_p95_ms
        return self.errors == 0 and ttft and tpot


def request_set(passages: list[str], cfg: LoadtestConfig, server_cap: int) -> list[LoadRequest]:
    """The same requests for every level and every run with this seed: N words of a passage (N drawn from
    `prompt_words`; its first ones, or from a random word on with `prompt_start: anywhere`) and a budget drawn
    from `max_tokens` (capped at the server's `serve.max_new_tokens`)."""
    rng = np.random.default_rng(cfg.seed)
    requests = []
    for _ in range(cfg.requests_per_level):
        words = passages[int(rng.integers(len(passages)))].split()
        count = int(rng.integers(cfg.prompt_words[0], cfg.prompt_words[1] + 1))
        budget = int(rng.integers(cfg.max_tokens[0], cfg.max_tokens[1] + 1))
        start = int(rng.integers(max(len(words) - count, 0) + 1)) if cfg.prompt_start == "anywhere" else 0
        requests.append(LoadRequest(" ".join(words[start : start + count]), min(budget, server_cap)))
    return requests


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


def summarize(
    concurrency: int,
    outcomes: list[Outcome],
    wall_s: float,
    engine: dict[str, float] | None = None,
    rate: float = float("nan"),
    slo: SloConfig | None = None,
) -> LevelResult:
    ok = [o for o in outcomes if o.status == 200]
    ttft = np.array([o.ttft_s for o in ok if o.ttft_s == o.ttft_s]) * 1000
    e2e = np.array([o.total_s for o in ok]) * 1000
    tpot = np.array([o.tpot_s for o in ok if o.tpot_s == o.tpot_s]) * 1000
    itl = (
        np.concatenate([np.diff(o.token_times) for o in ok if len(o.token_times) > 1] or [np.array([])])
        * 1000
    )

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else float("nan")

    return LevelResult(
        concurrency=concurrency,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        wall_s=wall_s,
        requests_s=len(ok) / wall_s,
        tok_s=sum(o.tokens for o in ok) / wall_s,
        ttft_p50_ms=pct(ttft, 50),
        ttft_p95_ms=pct(ttft, 95),
        e2e_p50_ms=pct(e2e, 50),
        e2e_p95_ms=pct(e2e, 95),
        decode_tok_s=engine["decoded"] / engine["decode_s"]
        if engine and engine["decode_s"]
        else float("nan"),
        prefill_share=engine["prefill_s"] / wall_s if engine else float("nan"),
        rate_rps=rate,
        tpot_p50_ms=pct(tpot, 50),
        tpot_p95_ms=pct(tpot, 95),
        itl_p50_ms=pct(itl, 50),
        itl_p95_ms=pct(itl, 95),
        goodput_rps=sum(o.meets(slo) for o in outcomes) / wall_s if slo else float("nan"),
    )


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


def offline_same_mix(
    runtime: Any,
    requests: list[LoadRequest],
    clients: int,
    max_batch: int,
    prefill_chunk: int = 0,
    prefix_reuse: bool = True,
    step_tokens: int = DEFAULT_STEP_TOKENS,
) -> float:
    """Generated tok/s of the same request set run through the same engine and scheduler settings in this
    process, without HTTP or a client in between (`clients` in flight at once, each sending its next as one ends;
    greedy, stopping at the end-of-sequence token as served requests do): the ceiling the served figures are read
    against. A fresh scheduler, so no prefix of an earlier level is in its cache; its decoder is made and warmed
    by one short request before the clock starts (the server's was, by the load test's warm-up request: timing
    that setup made the replay read 183 tok/s where the server delivered 240)."""
    import threading

    from serving.scheduler import GenerationRequest, Sampling, Scheduler

    eos = runtime.eos_token_id
    stops = frozenset() if eos is None else frozenset({eos})
    prompts = [runtime.encode(request.prompt) for request in requests]
    queue = max(len(requests), 1)
    scheduler = Scheduler(runtime, max_batch, queue, None, prefill_chunk, prefix_reuse, step_tokens)
    lock, pending, produced, finished = (
        threading.Lock(),
        list(range(len(requests))),
        [0],
        threading.Semaphore(0),
    )

    def send() -> None:
        with lock:
            if not pending:
                return
            index = pending.pop(0)

        def on_event(event: tuple[str, Any]) -> None:
            if event[0] == "token":
                with lock:
                    produced[0] += 1
            else:
                finished.release()
                send()

        scheduler.submit(
            GenerationRequest(prompts[index], requests[index].max_tokens, Sampling(), on_event, stops)
        )

    warmed = threading.Event()

    def on_warm_up(event: tuple[str, Any]) -> None:
        if event[0] != "token":
            warmed.set()

    started = time.perf_counter()
    try:
        scheduler.submit(GenerationRequest(prompts[0], 1, Sampling(), on_warm_up, stops))
        warmed.wait()
        started = time.perf_counter()
        for _ in range(min(clients, len(requests))):
            send()
        for _ in requests:
            finished.acquire()
    finally:
        scheduler.close()
    return produced[0] / (time.perf_counter() - started)


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
    from mlflow import MlflowClient

    client = MlflowClient()
    run_id = client.get_model_version(registered, version).run_id
    metrics = client.get_run(run_id).data.metrics if run_id else {}
    batches = [
        (int(k.removeprefix("decode_tok_s_bs")), v)
        for k, v in metrics.items()
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
    import mlflow
    from mlflow import MlflowClient

    registered, _, version = entry["served_id"].rpartition("/")
    trial = {id(result): number for number, result in enumerate(searched, 1)}
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=f"loadtest {entry['served_id']}") as run:
        mlflow.set_tags(
            {
                "llmopt.kind": "loadtest",
                "llmopt.model": registered,
                "llmopt.model_version": version,
                "llmopt.variant": entry["variant"],
                "llmopt.engine": entry["engine"],
            }
        )
        mlflow.log_params(settings)
        for result in results:
            fields = asdict(result)
            concurrency, rate = fields.pop("concurrency"), fields.pop("rate_rps")
            prefix = f"r{rate:g}" if rate == rate else f"c{concurrency}"
            if id(result) in trial:  # the SLO search's trials: keys of their own, beside the rates asked for
                prefix = f"s{trial[id(result)]}"
                mlflow.log_metric(f"{prefix}.rate_rps", rate)
            mlflow.log_metrics(
                {f"{prefix}.{k}": float(v) for k, v in fields.items() if v == v}
            )  # nan: not measured
        if ceiling:
            mlflow.log_metric(f"offline_decode_tok_s_bs{ceiling[0]}", ceiling[1])
        for clients, tok_s in (same_mix or {}).items():
            mlflow.log_metric(f"offline_same_mix.c{clients}.tok_s", tok_s)
        if best is not None:
            mlflow.log_metrics({"slo.max_rate_rps": best.rate_rps, "slo.goodput_rps": best.goodput_rps})
    MlflowClient().set_model_version_tag(registered, version, "llmopt.loadtest_run", run.info.run_id)
    return run.info.run_id

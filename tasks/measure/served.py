"""Served capacity: what clients get from a variant served by llmopt's own scheduler, in numbers a server is judged
by (generated tok/s, time to first token, time per output token, goodput under the SLO).

One request mix and one summary for the two places that measure it: `llmopt loadtest` drives a running server over
HTTP with it, and the benchmark stage replays it in the benchmark's process through the real scheduler (the
same batching settings as `serve`), closed loop, at each of `benchmark.served_clients` client counts, so the
leaderboard and `select.objective: serving` read what serving delivers, not what a batched `generate` call
would."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from serving.models import Limits
from serving.requests import GenerationRequest
from serving.sampling import Sampling
from tasks.config import LoadtestConfig, SloConfig
from tasks.errors import DataValidationError
from tasks.params import Config


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int
    tokens: int | None = (
        None  # the prompt cut to its first this many tokens (served lengths); None: all of it
    )


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

    @property
    def capacity(self) -> float:
        """What `select.objective: serving` ranks by: goodput (requests/s within the SLO) where an SLO was set,
        else generated tok/s."""
        return self.goodput_rps if self.goodput_rps == self.goodput_rps else self.tok_s


def served_metrics(levels: tuple[LevelResult, ...] | list[LevelResult]) -> dict[str, float]:
    """A model's served capacity as flat numbers, per client count (`served_tok_s_c16`, …), as metrics.json, the
    metrics suite and MLflow take them; goodput only where an SLO was set."""
    fields = {
        "tok_s": 2,
        "requests_s": 3,
        "ttft_p50_ms": 1,
        "ttft_p95_ms": 1,
        "tpot_p95_ms": 2,
        "e2e_p95_ms": 1,
    }
    metrics = {}
    for level in levels:
        values = {name: getattr(level, name) for name in fields} | {"goodput_rps": level.goodput_rps}
        digits = fields | {"goodput_rps": 3}
        metrics |= {
            f"served_{name}_c{level.concurrency}": round(value, digits[name])
            for name, value in values.items()
            if value == value  # nan: not measured (no SLO, or answers of one token)
        }
    return metrics


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


REPLAY_TIMEOUT_S = (
    600.0  # a request of the replay unanswered this long: the scheduler is stuck (an error, not a hang)
)


@dataclass(frozen=True)
class ServedPlan:
    """What the benchmark replays to measure served capacity: the request mix, the server's scheduler settings,
    and the SLO its goodput is counted against."""

    requests: tuple[LoadRequest, ...]
    limits: Limits
    slo: SloConfig | None = None
    # benchmark.served_lengths: per window length, the requests of its largest burst (a burst of c takes the first c)
    lengths: tuple[tuple[int, tuple[LoadRequest, ...]], ...] = ()
    length_clients: tuple[int, ...] = ()  # benchmark.served_length_clients, ascending


def prompt_passages(config: Config, data: Path) -> list[str]:
    """The passages the load test's prompts come from (`loadtest.prompt_source`), in the prepared data folder."""
    if config.loadtest.prompt_source == "long_documents":
        from tasks.inputs.long_documents import read_prepared

        return [text for _, text in read_prepared(data)]
    from tasks.inputs.data import read_split

    return read_split(data, "evaluation")


def served_plan(config: Config, data: Path) -> ServedPlan | None:
    """The benchmark's served measurement for this configuration: the load test's request mix (its seed, prompt
    lengths and budgets; `benchmark.served_requests` of them) and `serve`'s scheduler settings; None when
    `benchmark.served_clients` is empty."""
    bench = config.benchmark
    if not bench.served_clients and not bench.served_lengths:
        return None
    mix = config.loadtest.model_copy(update={"requests_per_level": bench.served_requests})
    requests = (
        request_set(prompt_passages(config, data), mix, config.serve.max_new_tokens)
        if bench.served_clients
        else []
    )
    lengths = ()
    if bench.served_lengths:
        from tasks.inputs.long_documents import read_prepared

        documents = [text for _, text in read_prepared(data)]
        clients = max(bench.served_length_clients)
        lengths = tuple(
            (
                length,
                tuple(
                    length_requests(documents, length, clients, config.loadtest, config.serve.max_new_tokens)
                ),
            )
            for length in bench.served_lengths
        )
    return ServedPlan(
        tuple(requests),
        Limits.of(config.serve),
        config.slo,
        lengths,
        tuple(sorted(bench.served_length_clients)),
    )


def length_requests(
    documents: list[str], length: int, count: int, cfg: LoadtestConfig, server_cap: int
) -> list[LoadRequest]:
    """`count` requests whose prompt and answer fill a window of `length` tokens: each a seeded document's words
    from a seeded word on (no two requests share a start), cut to `length` - budget tokens when encoded, the budget
    drawn from `loadtest.max_tokens` (capped at `serve.max_new_tokens`). A word is at least one token, so `length`
    words hold the prompt."""
    rng = np.random.default_rng([cfg.seed, length])
    usable = [words for words in (text.split() for text in documents) if len(words) >= length]
    if not usable:
        raise DataValidationError(f"benchmark.served_lengths: no long document has {length} words")
    requests, starts = [], set()
    while len(requests) < count:
        document = int(rng.integers(len(usable)))
        words = usable[document]
        start = int(rng.integers(len(words) - length + 1))
        if (document, start) in starts and len(starts) < sum(len(w) - length + 1 for w in usable):
            continue  # another request's start (its prefix would be reused): draw again while others are left
        starts.add((document, start))
        budget = min(int(rng.integers(cfg.max_tokens[0], cfg.max_tokens[1] + 1)), server_cap)
        requests.append(LoadRequest(" ".join(words[start : start + length]), budget, length - budget))
    return requests


def replay(
    runtime: Any,
    requests: list[LoadRequest] | tuple[LoadRequest, ...],
    clients: int,
    limits: Limits,
    stop_at_eos: bool = True,
) -> tuple[list[Outcome], float]:
    """The requests through a fresh scheduler of `runtime` with `limits` in this process, `clients` in flight at
    once (each sends its next as one ends), greedy: (each request's outcome, timed from its submission, and the
    wall time). No HTTP or client in between, so a server cannot beat it. Fresh, so nothing of an earlier replay is
    in its cache; its decoder is made and warmed before the clock starts by one short request that shares no start
    with the mix (the first prompt's tokens reversed). `stop_at_eos` off: every request runs to its budget (the
    same work for every variant)."""
    eos = runtime.eos_token_id
    stops = frozenset() if eos is None or not stop_at_eos else frozenset({eos})
    prompts = [_prompt_ids(runtime, request) for request in requests]
    # the model steps on this thread, the clients' side runs on another (see `Scheduler.run`)
    scheduler = replace(limits, max_queue=max(len(requests), 1)).scheduler(runtime, own_thread=False)
    lock, pending = threading.Lock(), list(range(len(requests)))
    outcomes: list[Outcome] = []
    finished = threading.Semaphore(0)

    def send() -> None:
        with lock:
            if not pending:
                return
            index = pending.pop(0)
        started, times = time.perf_counter(), []

        def on_event(event: tuple[str, Any]) -> None:
            if event[0] == "token":
                times.append(time.perf_counter() - started)
                return
            if event[0] == "prompt":
                return
            status = 200 if event[0] == "done" else 500
            first = times[0] if times else float("nan")
            with lock:
                outcomes.append(
                    Outcome(status, first, time.perf_counter() - started, len(times), tuple(times))
                )
            finished.release()
            send()

        try:
            scheduler.submit(
                GenerationRequest(
                    prompts[index],
                    requests[index].max_tokens,
                    Sampling(),
                    on_event,
                    stops,
                    token_logprobs=False,  # as the load test's clients: they ask for none
                )
            )
        except (
            Exception
        ):  # a worker that stopped (its error is in the log): this request fails, the rest go on
            with lock:
                outcomes.append(Outcome(500, float("nan"), time.perf_counter() - started, 0))
            finished.release()
            send()

    warmed, result = threading.Event(), {}

    def drive() -> None:
        try:
            warm_up = prompts[0][::-1][:16] or prompts[0]
            scheduler.submit(
                GenerationRequest(
                    warm_up, 1, Sampling(), lambda e: e[0] in ("done", "error") and warmed.set()
                )
            )
            if not warmed.wait(REPLAY_TIMEOUT_S):
                raise TimeoutError(
                    f"the served replay's warm-up request got no answer in {REPLAY_TIMEOUT_S:g} s"
                )
            started = time.perf_counter()
            for _ in range(min(clients, len(requests))):
                send()
            for _ in requests:
                if not finished.acquire(timeout=REPLAY_TIMEOUT_S):
                    raise TimeoutError(f"a served replay's request got no answer in {REPLAY_TIMEOUT_S:g} s")
            result["wall"] = time.perf_counter() - started
        except BaseException as exc:  # raised on the caller's thread below
            result["error"] = exc
        finally:
            scheduler.close(wait=False)

    clients_side = threading.Thread(target=drive, name="llmopt-replay-clients", daemon=True)
    clients_side.start()
    try:
        scheduler.run()  # until the clients' side closes it and every request has ended
    finally:
        scheduler.close(wait=False)
    clients_side.join()
    if "error" in result:
        raise result["error"]
    return outcomes, result["wall"]


def _prompt_ids(runtime: Any, request: LoadRequest) -> list[int]:
    ids = runtime.encode(request.prompt)
    if request.tokens is None:
        return ids
    if len(ids) < request.tokens:
        raise DataValidationError(f"a served-length prompt has {len(ids)} tokens, under {request.tokens}")
    return ids[: request.tokens]


def served_capacity(runtime: Any, plan: ServedPlan, clients: list[int]) -> list[LevelResult]:
    """The plan's requests replayed at each client count (every request to its budget), summarized as the load
    test summarizes a level (goodput against the plan's SLO)."""
    levels = []
    for count in clients:
        outcomes, wall = replay(runtime, plan.requests, count, plan.limits, stop_at_eos=False)
        levels.append(summarize(count, outcomes, wall, slo=plan.slo))
    return levels

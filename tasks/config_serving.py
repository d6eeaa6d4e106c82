"""The typed configuration of serving, on the configuration's ground floor beside tasks/config.py (which offers
these sections too): the server (`serve`), the service-level objective (`slo`) and the load test (`loadtest`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tasks.schema import Strict

# serve.sequence_tokens' default for llama.cpp's server decoder (a KV stream per row)
LLAMA_STREAM_TOKENS = 2048


class ServeConfig(Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    # What the server answers with, routed by the request's `model` field (the first answers requests naming
    # none): a registry alias of this project's model, `name@alias` of any registered model, or `name/version`.
    models: Annotated[
        list[Annotated[str, Field(pattern=r"^[\w.\-]+([@/][\w.\-]+)?$")]], Field(min_length=1)
    ] = ["production"]
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    # How often the server asks the registry where each alias points; a move is loaded, verified and swapped in
    # without dropping requests. 0: never (serve what was loaded at start).
    watch_s: Annotated[float, Field(ge=0, le=86_400)] = 10.0
    # Requests decoded together per model (iteration-level batching); 1 runs them one after another. 16: at 16
    # clients it gave +40 % tok/s and 10x lower median TTFT over 8 (docs/results/2026-12-05-serving.md)
    max_batch: Annotated[int, Field(ge=1, le=64)] = 16
    # Requests waiting per model beyond the batch; more get 429 with Retry-After instead of an unbounded wait.
    max_queue: Annotated[int, Field(ge=1, le=10_000)] = 64
    # Tokens per engine call (llama.cpp, ONNX, torch bf16/fp16): one per running request, the rest for slices of
    # joining prompts, several prompts per step, first come first fed (in the running requests' call: llama.cpp and
    # torch's slots; in calls right after it: ONNX; torch fp32 runs prompts whole). Newcomers join while it has
    # room; a longer prompt is sliced. Bounds what running streams wait per token while prompts arrive. At least
    # max_batch. 2048: a 16-request burst's prompts join in one step; against 256 at 16 clients, in process, torch
    # bf16 TTFT p95 ~740 -> ~530 ms and tok/s +3-5 % (128-token prompts), ONNX and llama.cpp within the noise
    # (docs/results/2026-12-05-serving.md)
    step_tokens: Annotated[int, Field(ge=1, le=65_536)] = 2048
    # The most tokens of one prompt per step (within step_tokens); 0: step_tokens alone decides.
    prefill_chunk: Annotated[int, Field(ge=0, le=8192)] = 0
    # Prefix reuse (llama.cpp, ONNX, torch bf16/fp16): a prompt starting like a sequence in the cache takes its
    # K/V for the shared part
    prefix_reuse: bool = True
    # ... and finished requests' K/V, least recently used out first, up to this many tokens (llama-server's
    # cache_prompt, vLLM's prefix caching; ONNX, torch: <= 1/4 of free memory); 0: from running requests only
    prefix_cache_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 16_384
    # The most tokens one request holds, prompt and answer (longer requests get 400), where the engine sizes that
    # room up front for every row (llama.cpp: a KV stream of this many cells per row of max_batch; None: 2048 there,
    # the model's context elsewhere). Long documents need more: the document_qa profile sets the model's 8 192
    sequence_tokens: Annotated[int, Field(ge=256, le=1_048_576)] | None = None
    request_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0  # queued + generating, then 504
    # Clients must send `Authorization: Bearer <key>` when this environment variable is set (and not empty).
    api_key_env: str = "LLMOPT_API_KEY"
    max_body_kb: Annotated[int, Field(ge=1, le=102_400)] = 1024  # larger request bodies get 413
    # A request body not complete this long after it began gets 408 and its connection closed (a client trickling
    # its body holds nothing for long)
    body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # Request bodies beyond their first 64 KB are read at this rate at most, all requests together: large prompts
    # queue (TCP holds their senders back) instead of taking the event loop that streams every answer; 0: no limit
    body_mb_per_s: Annotated[float, Field(ge=0, le=100_000)] = 8.0
    # Open connections at most (uvicorn's limit_concurrency: more get 503); far above what honest clients hold
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 1024

    @model_validator(mode="after")
    def _budget_holds_a_step(self) -> ServeConfig:
        if self.step_tokens < self.max_batch:
            raise ValueError(
                f"step_tokens ({self.step_tokens}) must be at least max_batch ({self.max_batch}): every running "
                "request takes one token of each step"
            )
        return self


class SloConfig(Strict):
    """The service-level objective, defined once (the top-level `slo:`): p95 time to first token and p95 time per
    output token (after the first), each in ms; at least one. The load test reports goodput against it and
    searches the highest rate that meets it; the benchmark's served capacity reports goodput, which
    `select.objective: serving` ranks by."""

    ttft_p95_ms: Annotated[float, Field(gt=0)] | None = None
    tpot_p95_ms: Annotated[float, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> SloConfig:
        if self.ttft_p95_ms is None and self.tpot_p95_ms is None:
            raise ValueError("set ttft_p95_ms, tpot_p95_ms or both (or leave slo out)")
        return self


class LoadtestConfig(Strict):
    """`llmopt loadtest`: the request set, the concurrency levels (closed loop) and request rates (open loop,
    Poisson arrivals) it drives a running server with, and an optional SLO: goodput at each level, and a search
    for the highest rate that meets it (`search_trials` trials, from the 1-client rate, or 1 req/s)."""

    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] = [1, 4, 16]
    rates: list[Annotated[float, Field(gt=0, le=10_000)]] = []
    search_trials: Annotated[int, Field(ge=0, le=20)] = 6
    # The same request set run offline through the same engine in this process (the served version, downloaded),
    # with one client and with the most clients of `concurrency`: the ceiling the served figures are read against
    offline_ceiling: bool = True
    requests_per_level: Annotated[int, Field(ge=1, le=100_000)] = 48
    seed: int = 0
    prompt_words: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)] = [8, 160]
    # Where a prompt starts in its passage: "first" (its first words: prompts from one passage share a start, as
    # chats sharing a system prompt do) or "anywhere" (a random word: no shared prefixes)
    prompt_start: Literal["first", "anywhere"] = "first"
    # The passages prompts come from: the evaluation split, or the long documents of `long_context` (document QA)
    prompt_source: Literal["evaluation", "long_documents"] = "evaluation"
    max_tokens: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)] = [16, 64]

    @model_validator(mode="after")
    def _ranges_ascend(self) -> LoadtestConfig:
        for name in ("prompt_words", "max_tokens"):
            low, high = getattr(self, name)
            if low > high:
                raise ValueError(f"{name}: [low, high] with low <= high, got [{low}, {high}]")
        return self

"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServerMetrics:
    """What operators watch: requests by route and status, latency and time to first token, queue depth,
    batch sizes, engine calls, tokens in and out."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llmopt_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "llmopt_request_seconds",
            "End-to-end request time",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llmopt_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.waited = Histogram(
            "llmopt_queue_wait_seconds", "Time queued", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("llmopt_queue_depth", "Requests waiting per model", ["model"], registry=r)
        self.batch_size = Histogram(
            "llmopt_batch_size", "Sequences per batched engine step", buckets=BATCH_BUCKETS, registry=r
        )
        self.calls = Counter("llmopt_engine_calls", "Engine calls (prompts run + batched steps)", registry=r)
        self.engine_time = Counter(
            "llmopt_engine_seconds",
            "Time inside the engine: prompts (prefill) and batched steps (decode)",
            ["phase"],
            registry=r,
        )
        self.tokens = Counter(
            "llmopt_tokens", "Tokens by direction (prompt in, generated out)", ["direction"], registry=r
        )

    def queue_wait(self, seconds: float) -> None:
        self.waited.observe(seconds)

    def batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def engine_calls(self, count: int) -> None:
        self.calls.inc(count)

    def engine_seconds(self, phase: str, seconds: float) -> None:
        self.engine_time.labels(phase).inc(seconds)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

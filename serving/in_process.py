"""`llmopt serve`'s app for a loaded runtime in this process: under uvicorn on a free loopback port, in a thread
(`serving_in_thread`), and a level of the load test's streamed clients against it (`served_over_http`). The GPU
check serves what it has just measured this way (no registry, no second process holding the GPU), beside the same
requests replayed offline through the same scheduler (tasks/measure/served.py `replay`): the offline figure is
the ceiling the served one is read against."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from serving.models import Limits, LoadedModel, ServedModel
from tasks.config import ServeConfig
from tasks.measure.served import LevelResult, LoadRequest, summarize


def serve_runtime(runtime: Any, name: str, version: str, settings: ServeConfig) -> ServedModel:
    """A runtime already in memory, served as `name/version` (never swapped), as `llmopt serve` serves a loaded
    registry version."""
    scheduler = Limits.of(settings).scheduler(runtime, None)
    return ServedModel(name, None, LoadedModel(version, runtime, scheduler))


@contextlib.contextmanager
def serving_in_thread(
    runtime: Any, name: str, settings: ServeConfig, version: str = "1"
) -> Iterator[tuple[str, Any]]:
    """(URL, served model) of the app serving `runtime` as `name`, under uvicorn on a free loopback port in a
    thread; stopped on exit. The socket listens before uvicorn starts, so clients can connect at once (the kernel
    queues them)."""
    import uvicorn

    from serving.app import create_app
    from serving.models import ModelRouter

    served = serve_runtime(runtime, name, version, settings)
    app = create_app(ModelRouter([served]), settings)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", served
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def served_over_http(
    runtime: Any, requests: tuple[LoadRequest, ...] | list[LoadRequest], clients: int, limits: Limits
) -> LevelResult:
    """`requests` sent by `clients` streaming clients (the load test's, greedy, each answer to its budget:
    `ignore_eos`) to the app serving `runtime` with the scheduler settings `limits`; one short request first, so
    the server's decoder is made (and, on a GPU, its steps compiled) before the clock starts, as the offline
    replay's is."""
    from serving.loadtest import run_level

    settings = ServeConfig.model_validate(  # `Limits.of`'s fields are serve's own
        {
            **asdict(limits),
            "max_queue": max(limits.max_queue, len(requests)),
            "max_new_tokens": max(request.max_tokens for request in requests),
        }
    )
    warm_up = LoadRequest(" ".join(reversed(requests[0].prompt.split()[:16])), 1)
    with serving_in_thread(runtime, "served", settings) as (url, _):
        asyncio.run(run_level(url, None, [warm_up], 1, None))
        outcomes, wall = asyncio.run(run_level(url, None, list(requests), clients, None, ignore_eos=True))
    return summarize(clients, outcomes, wall)


def level_figures(level: LevelResult) -> dict[str, Any]:
    """A level's throughput, latency and errors, rounded for a report (None where not measured)."""
    keep = ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p95_ms", "e2e_p95_ms")
    figures = asdict(level)
    return {
        **{key: round(figures[key], 2) if figures[key] == figures[key] else None for key in keep},
        "errors": level.errors,
    }

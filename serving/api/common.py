"""What both wire APIs use: the server state routes reach through the request, the API key check, starting a
generation and streaming it as server-sent events."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from serving.generation import Generation
from serving.metrics import ServerMetrics
from serving.models import ModelRouter, ServedModel
from serving.sampling import Sampling
from serving.text import RequestError
from tasks.config import ServeConfig


@dataclass(frozen=True)
class ServerState:
    """What `create_app` puts in `app.state.server` for the routes: the served models, the settings, the
    metrics and the API key (None: none configured)."""

    model_router: ModelRouter
    settings: ServeConfig
    metrics: ServerMetrics
    api_key: str | None


def state_of(request: Request) -> ServerState:
    """The state of the app answering `request`."""
    return request.app.state.server


def require_api_key(request: Request) -> None:
    """A dependency refusing requests without `Authorization: Bearer <key>` (no key configured: all pass)."""
    key = state_of(request).api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise RequestError(
            401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error"
        )


def start_generation(
    http: Request,
    served: ServedModel,
    prompt: list[int],
    max_tokens: int,
    body: Any,
    sampling: Sampling | None = None,
    token_logprobs: bool | None = None,
) -> Generation:
    """Queue `prompt` on `served`'s scheduler with the request's sampling (or `sampling`) and stops (429 when the
    queue is full); each token's log-probability computed where `token_logprobs` (default: the body's
    `token_logprobs`, else always)."""
    state = state_of(http)
    generation = Generation(
        served,
        prompt,
        max_tokens,
        sampling or body.sampling(),
        body.stops(),
        state.settings.request_timeout_s,
        state.metrics,
        ignore_eos=getattr(body, "ignore_eos", False),
        prompt_logprobs=bool(getattr(body, "prompt_logprobs", False)),
        token_logprobs=getattr(body, "token_logprobs", True) if token_logprobs is None else token_logprobs,
    )
    generation.start()
    return generation


class _CancellingStream(StreamingResponse):
    """A stream whose request is cancelled however the response ends, even before its first byte (a client
    that leaves that early never starts the generator whose cleanup would cancel it)."""

    def __init__(self, generation: Generation | list[Generation], lines: AsyncIterator[str]) -> None:
        super().__init__(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._generations = generation if isinstance(generation, list) else [generation]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self._generations:
                generation.request.cancel()


def sse(
    generation: Generation | list[Generation],
    events: AsyncIterator[dict],
    error_event: Callable[[RequestError], dict],
    done: str | None = None,
) -> StreamingResponse:
    """Server-sent events; an error after the stream has started is sent as a last event in the API's own error
    shape (`error_event`), then `done` if the API ends its streams with a marker (OpenAI's `[DONE]`)."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except RequestError as exc:
            yield f"data: {json.dumps(error_event(exc))}\n\n"
        if done is not None:
            yield f"data: {done}\n\n"

    return _CancellingStream(generation, lines())

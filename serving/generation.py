"""One request's generation as the HTTP layer sees it: validated against the model's context, queued on the
model's scheduler, its tokens turned into safe text pieces, ended by EOS, max tokens, a stop string, a timeout
or the client going away (which cancels the remaining work)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serving.models import ServedModel
from serving.requests import GenerationRequest, QueueFull, SchedulerClosed
from serving.sampling import Sampling
from serving.text import RequestError, TextStream

RETRY_AFTER_S = 1  # what a 429 suggests: a batch step frees slots every few hundred milliseconds at most
DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request asks whether its client is still there


@dataclass
class Piece:
    """A generated token and the text it released ('' while held back); `token` is None for the final text
    released at the end."""

    text: str
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = (
        None  # the most likely tokens there, when the request asked for them
    )


@dataclass
class PromptScores:
    """The prompt's tokens with their log-probabilities (the first has none) and, when asked, the most likely
    tokens at each position; sent before the first generated token when the request asked for them."""

    entries: list[tuple[int, float | None, list[tuple[int, float]] | None]]


@dataclass
class Finish:
    reason: str  # "stop" (EOS or a stop string) or "length"
    completion_tokens: int
    stop_string: bool = False  # a stop string (not the end-of-sequence token) ended it
    stop_text: str = ""  # that stop string


class Generation:
    """Build, then `start` (queues it; 429 when the queue is full), then iterate `events`."""

    def __init__(
        self,
        served: ServedModel,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stops: list[str],
        timeout_s: float,
        metrics: Any,
        ignore_eos: bool = False,
        prompt_logprobs: bool = False,
        token_logprobs: bool = True,
    ) -> None:
        self.served, self.loaded = served, served.current  # this request's model, even if a swap happens
        runtime = self.loaded.runtime
        # the model's context, or the server's room per request where that is less (llama.cpp's streams)
        context = self.loaded.scheduler.request_tokens or runtime.context_length
        if len(prompt) + max_tokens > context:
            what = (
                "the model's context"
                if context == runtime.context_length
                else "the server's room per request"
            )
            raise RequestError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {len(prompt) + max_tokens} tokens "
                f"exceeds {what} of {context} tokens",
                "context_length_exceeded",
            )
        self.prompt, self.max_tokens, self.timeout_s, self.metrics = prompt, max_tokens, timeout_s, metrics
        self.text = TextStream(runtime.tokenizer, stops)
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        eos = runtime.eos_token_id
        self.request = GenerationRequest(
            prompt,
            max_tokens,
            sampling,
            lambda event: loop.call_soon_threadsafe(self._queue.put_nowait, event),
            stop_ids=frozenset() if eos is None or ignore_eos else frozenset({eos}),
            prompt_logprobs=prompt_logprobs,
            token_logprobs=token_logprobs,
        )
        self._started = loop.time()

    def start(self) -> None:
        """Queue the request on its model's scheduler (the current one if a swap retired the first)."""
        try:
            try:
                self.loaded.scheduler.submit(self.request)
            except SchedulerClosed:
                self.loaded = self.served.current
                self.loaded.scheduler.submit(self.request)
        except QueueFull:
            raise RequestError(
                429,
                f"the server is at capacity ({self.loaded.scheduler.max_queue} requests queued); retry later",
                "rate_limit_exceeded",
            ) from None
        except SchedulerClosed:
            raise RequestError(503, "the server is shutting down", "unavailable") from None
        if self.metrics:
            self.metrics.tokens.labels("in").inc(len(self.prompt))

    async def events(
        self, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[Piece | PromptScores | Finish]:
        """Pieces as tokens arrive, then one Finish; raises RequestError on timeout or an engine failure. Leaving
        early (a stop string, the client gone) cancels what the model has left to do for this request."""
        loop, produced = asyncio.get_running_loop(), 0
        checked = loop.time()
        deadline = self._started + self.timeout_s
        try:
            while True:
                kind, value = await self._next(loop, deadline, disconnected)
                if kind == "token":
                    token, logprob, top = value
                    produced += 1
                    if produced == 1 and self.metrics:
                        self.metrics.ttft.observe(loop.time() - self._started)
                    yield Piece(self.text.push(token), token, logprob, top)
                    if self.text.stopped:
                        yield self._finish("stop", produced)
                        return
                    if disconnected is not None and loop.time() - checked >= DISCONNECT_CHECK_S:
                        checked = loop.time()
                        if await disconnected():  # nobody reads the answer any more
                            raise RequestError(499, "client closed the connection", "cancelled")
                elif kind == "prompt":
                    yield PromptScores(value)
                elif kind == "done":
                    tail = self.text.finish()
                    if tail:
                        yield Piece(tail)
                    yield self._finish("stop" if self.text.stopped else value, produced)
                    return
                else:
                    raise RequestError(500, value, "server_error")
        finally:
            self.request.cancel()  # a no-op once finished; otherwise frees the request's batch slot

    async def _next(
        self, loop: Any, deadline: float, disconnected: Callable[[], Awaitable[bool]] | None
    ) -> Any:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise RequestError(
                    504, f"no answer within {self.timeout_s:g} s (serve.request_timeout_s)", "timeout"
                )
            try:  # wake up now and then to notice a client that went away (non-streaming requests)
                return await asyncio.wait_for(self._queue.get(), min(left, DISCONNECT_CHECK_S))
            except TimeoutError:
                if disconnected is not None and await disconnected():  # nobody reads the answer any more
                    raise RequestError(499, "client closed the connection", "cancelled") from None

    def _finish(self, reason: str, produced: int) -> Finish:
        if self.metrics:
            self.metrics.tokens.labels("out").inc(produced)
        return Finish(
            "stop" if reason == "cancelled" else reason,
            produced,
            stop_string=self.text.stopped,
            stop_text=self.text.stop_text,
        )

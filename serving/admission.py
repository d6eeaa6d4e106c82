"""The scheduler's admission of prompts under a token budget: which queued requests join a step (a free row, KV room
for every held request's prompt and token budget, prompt tokens left in the step's `step_tokens`), and how much of a
joining prompt one step feeds. A part of `Scheduler` (serving/scheduler.py), kept apart as its speculative step is:
it reads the scheduler's queue and limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.requests import GenerationRequest


@dataclass(eq=False)
class Filling:
    """A request whose prompt joins in slices (chunked prefill): `fed` of its tokens are in the cache."""

    request: GenerationRequest
    sequence: int
    fed: int = 0


class PromptAdmission:
    """Admission and prompt slices of `Scheduler`; the attributes below are the scheduler's."""

    _queue: Any
    max_batch: int
    step_tokens: int
    prefill_chunk: int

    def _admissible(
        self, decoder: Any, running: dict[int, Any], filling: list[Filling]
    ) -> list[GenerationRequest]:
        """Take from the queue, in order, the requests this step has room for: a free row (`max_batch`), KV room
        for the prompt and token budget of every request held, and prompt tokens left in the step's budget (on
        decoders that take slices). The first that does not fit waits, and so does everyone behind it."""
        rows = len(running) + len(filling)
        held = sum(kv_need(r.request) for r in running.values()) + sum(kv_need(f.request) for f in filling)
        budget = self.step_tokens - len(running) - sum(self._slice(f) for f in filling)
        joining: list[GenerationRequest] = []
        while self._queue and rows < self.max_batch:
            request = self._queue[0]
            fills = self._fills(decoder, request)
            if decoder.kv_tokens is not None and rows and held + kv_need(request) > decoder.kv_tokens:
                break  # the cache is full until a running request ends
            if fills and budget <= 0:
                break  # this step's budget is spent: it joins in the next one
            joining.append(self._queue.popleft())
            rows, held = rows + 1, held + kv_need(request)
            budget -= min(len(request.prompt), self.prefill_chunk or len(request.prompt)) if fills else 0
        return joining

    def _slice(self, item: Filling) -> int:
        """The most tokens of `item`'s prompt one step feeds (the rest of it, at most `prefill_chunk`)."""
        left = len(item.request.prompt) - item.fed
        return min(left, self.prefill_chunk) if self.prefill_chunk else left

    def _fills(self, decoder: Any, request: GenerationRequest) -> bool:
        """Whether `request`'s prompt joins in slices under the step budget: an engine that takes slices beside
        the running requests, and a request that generates (scoring requests run their prompt whole)."""
        return decoder.chunked_prefill and request.max_tokens > 0 and not request.prompt_logprobs


def kv_need(request: GenerationRequest) -> int:
    """The KV cells a request may fill: its prompt and its token budget."""
    return len(request.prompt) + request.max_tokens

"""The server's speculative decoding: while one greedy request runs and none waits, the scheduler steps it with
the proposer's guesses in one engine call (the variant's runtime.speculative). A part of `Scheduler`
(serving/scheduler.py), kept apart: it reads the scheduler's queue, runtime and metrics and emits through it."""

from __future__ import annotations

import logging
from typing import Any

from serving.sampling import GREEDY_BELOW

log = logging.getLogger("llmopt.serve")


class SpeculativeSteps:
    """The speculative step of `Scheduler`; the attributes below are the scheduler's."""

    runtime: Any
    metrics: Any
    _queue: Any
    _speculating: Any

    def _speculates(self, decoder: Any, running: dict[int, Any]) -> bool:
        """Speculative decoding (the variant's runtime.speculative) while one greedy request runs and none waits:
        beside other requests, batching them gives more than guessing for one (docs/serving.md)."""
        speculation = getattr(self.runtime, "speculation", None)  # stand-in runtimes of tests have none
        if speculation is None or not speculation.enabled or not decoder.verifies or len(running) != 1:
            return False
        (item,) = running.values()
        request = item.request
        room = len(request.prompt) + request.max_tokens
        return request.sampling.temperature < GREEDY_BELOW and not self._queue and speculation.fits(room)

    def _speculative_step(self, decoder: Any, running: dict[int, Any]) -> None:
        """The running request's last token and the proposer's guesses in one engine call; each guess is kept
        while it is the token the request would choose there (penalties included), then one more from the
        logits after the last kept one, and the cache is rewound past the refused ones."""
        ((sequence, item),) = running.items()
        request, speculation = item.request, self.runtime.speculation
        if item.proposer is None or self._speculating is not item:
            # a draft engine keeps one sequence: a request that speculated before another did starts afresh
            capacity = len(request.prompt) + request.max_tokens
            item.proposer, self._speculating = speculation.proposer(capacity), item
        room = (
            request.max_tokens - item.produced - 1
        )  # a guess kept short of the budget leaves room for one more
        guesses = item.proposer.propose(
            request.prompt + item.generated, min(speculation.settings.tokens, room)
        )
        rows = decoder.verify(sequence, [item.last, *guesses])
        stats = speculation.stats
        stats.calls, stats.proposed = stats.calls + 1, stats.proposed + len(guesses)
        for index, row in enumerate(rows):
            try:
                self._emit(decoder, running, sequence, row)
            except Exception as exc:
                log.exception("a request failed choosing its token")
                self._drop(decoder, running, sequence, request, exc)
                self._speculating = None
                return
            if self.metrics:
                self.metrics.batch(1)  # a token decoded for a request running alone (the sum counts tokens)
            kept = index < len(guesses) and item.last == guesses[index]
            stats.accepted += kept
            if sequence not in running:  # finished (its cache is gone)
                self._speculating = None  # nor is its proposer kept
                return
            if not kept:
                break
        decoder.rewind(sequence, len(request.prompt) + len(item.generated) - 1)  # all but the last token

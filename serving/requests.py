"""What a request handler hands the scheduler: one request's generation (its prompt, budget, sampling and the
callback its tokens arrive through), and the two refusals a handler can meet when queueing it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.sampling import Sampling


class QueueFull(Exception):
    """The model's queue holds `max_queue` requests already (the server answers 429)."""


class SchedulerClosed(Exception):
    """The model was swapped out or the server is stopping: the request goes to the current model instead."""


@dataclass(eq=False)
class GenerationRequest:
    """One request's generation. `on_event` is called from the worker thread with ("token", (id, log-probability
    or None without `token_logprobs`, top)) for each token (`top`: the `sampling.top_logprobs` most likely (id,
    log-probability) pairs, or None) and finally ("done", finish_reason) or ("error", message); finish reasons:
    "stop" (an end-of-sequence token), "length" (max_tokens reached), "cancelled" (`cancel` was called: disconnect,
    timeout or a stop string)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    on_event: Callable[[tuple[str, Any]], None]
    stop_ids: frozenset[int] = frozenset()
    prompt_logprobs: bool = False  # first send ("prompt", [(id, log-probability or None, top or None), …])
    # each token's log-probability (else None): a softmax over the vocabulary, 0.14 ms a token of the worker's time
    # here (49 k tokens), 4-5 % of a 16-row llama.cpp step, so computed only for answers that report it
    token_logprobs: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)
    ended: bool = False  # its last event was sent (set by the scheduler, under its lock)

    def cancel(self) -> None:
        """Stop generating for this request at the next step boundary (its slot goes to the next in line)."""
        self.cancelled.set()

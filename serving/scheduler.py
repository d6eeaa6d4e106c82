"""Iteration-level batching: one worker thread per loaded model owns its engine and steps every running request
together, one token per step; queued requests join between steps and finished ones leave.

Engines are not thread-safe (og.Model, a torch module), and their bindings hold the GIL while stepping, so request
handlers never touch the engine: they queue a `GenerationRequest` and receive its tokens as events. The worker
picks each token itself from the step's logits (greedy or sampled, per request), which is what lets requests with
different sampling settings share a step.

Prompts are batched under a token budget (`step_tokens` per engine call, as vLLM's max_num_batched_tokens and
llama-server's n_batch): each step carries one token per running request, then the next slices of the prompts still
joining, first come first fed, then newcomers while the budget, `max_batch` rows and the decoder's KV room
(`kv_tokens`: every held request's prompt and token budget) allow. A request that does not fit waits in the queue;
only a full queue refuses (QueueFull). Engines without slices (torch) run each newcomer's prompt whole."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.admission import Filling, PromptAdmission
from serving.requests import GenerationRequest, QueueFull, SchedulerClosed
from serving.sampling import adjusted_logits, choose_token, logprob, prompt_scores, top_logprobs
from serving.speculative_steps import SpeculativeSteps
from tasks.config import ServeConfig
from tasks.engines import Runtime

__all__ = ["GenerationRequest", "QueueFull", "Scheduler", "SchedulerClosed"]

log = logging.getLogger("llmopt.serve")


DEFAULT_STEP_TOKENS: int = ServeConfig.model_fields["step_tokens"].default  # tasks/config.py says why
DEFAULT_PREFIX_CACHE_TOKENS: int = ServeConfig.model_fields["prefix_cache_tokens"].default


@dataclass(eq=False)
class _Running:
    request: GenerationRequest
    rng: np.random.Generator
    produced: int = 0
    last: int = -1
    generated: list[int] = field(default_factory=list)
    proposer: Any = None  # its speculative proposer, made on its first speculative step


class Scheduler(PromptAdmission, SpeculativeSteps):
    """The queue and the worker of one loaded model: a thread of its own (started on construction, stopped by
    `close`), or with `own_thread` off the thread that calls `run` (the served replay: see `run`)."""

    def __init__(
        self,
        runtime: Runtime,
        max_batch: int,
        max_queue: int,
        metrics: Any = None,
        prefill_chunk: int = 0,
        prefix_reuse: bool = True,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        own_thread: bool = True,
        sequence_tokens: int | None = None,
    ) -> None:
        if step_tokens < max_batch:
            raise ValueError(f"step_tokens ({step_tokens}) must be at least max_batch ({max_batch})")
        self.runtime, self.max_batch, self.max_queue = runtime, max_batch, max_queue
        self.prefill_chunk = prefill_chunk  # the most tokens of one prompt per step; 0: the budget alone
        # tokens per engine call: the running requests' and the prompt slices (see the module's docstring)
        self.step_tokens = step_tokens
        self.prefix_reuse = prefix_reuse  # for decoders that can (see serve.prefix_reuse)
        self.prefix_cache_tokens = prefix_cache_tokens  # ... and finished ones (serve.prefix_cache_tokens)
        self.sequence_tokens = (
            sequence_tokens  # one request's room where a decoder sizes it (serve.sequence_tokens)
        )
        self.metrics = metrics  # serving.metrics.ServerMetrics, or None (tests of the scheduler alone)
        self.steps = 0  # engine calls so far (prompts run alone + batched steps)
        self.in_flight = 0  # requests submitted and not yet ended (queued, joining or running)
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._speculating: _Running | None = None  # the request whose proposer is current
        self._thread: threading.Thread | None = None
        # set once the worker has made its decoder: a decoder may time its engines then (the ONNX decoder's
        # bfloat16 probe), and the caller waits for it so that nothing of its own runs beside that measurement
        # (a server building its app beside it held the GIL enough to make torch's calls 2-5x slower there)
        self._ready = threading.Event()
        self._failed_start: BaseException | None = None  # why the worker stopped before its decoder was made
        self.request_tokens: int | None = None  # the most tokens one request holds (set by `_decoder`)
        if own_thread:
            self._thread = threading.Thread(target=self._work, name="llmopt-scheduler", daemon=True)
            self._thread.start()
            while not self._ready.wait(1.0) and self._thread.is_alive():
                pass
            if self._failed_start is not None:  # a version whose engine cannot start is not loaded
                raise self._failed_start

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() if self._thread is not None else not self._closed

    def run(self) -> None:
        """The worker on the calling thread (a scheduler made with `own_thread` off), until `close` and every
        request it holds has ended. Where the engine's work must stay on one thread: PyTorch's OpenMP runtime
        keeps a team of threads per thread that computes, and once a second thread has computed, every step of
        either ran ~1.6x as long on 2 cores (a bf16 decode step: 38 ms → 61 ms), so the benchmark's replay steps
        the model on the thread that measured it."""
        if self._thread is not None:
            raise RuntimeError("this scheduler's worker runs on its own thread")
        self._work()

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; QueueFull when `max_queue` are waiting, SchedulerClosed after `close` (or if the
        worker has died)."""
        with self._wake:
            if self._closed or not self.alive:
                raise SchedulerClosed
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(request)
            self.in_flight += 1
            self._wake.notify_all()

    def wait_for(self, condition: Callable[[Scheduler], bool], timeout_s: float) -> bool:
        """Block until `condition(self)` holds (checked whenever the queue or the requests in flight change);
        False if it still does not after `timeout_s`."""
        with self._wake:
            return self._wake.wait_for(lambda: condition(self), timeout_s)

    def close(self, wait: bool = True) -> None:
        """Take no new requests; the worker finishes what is queued and running, then exits."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if wait and self._thread is not None:
            self._thread.join()

    def _work(self) -> None:
        running: dict[int, _Running] = {}
        try:
            self._serve(running)
        except BaseException as exc:  # the worker cannot go on: end every request it holds, refuse new ones
            log.exception("scheduler worker stopped")
            if not self._ready.is_set():
                self._failed_start = exc
            with self._wake:
                self._closed = True
                orphans = [*(item.request for item in running.values()), *self._queue]
                self._queue.clear()
            for request in orphans:
                self._end(request, ("error", f"the model's worker stopped: {_first_line(exc)}"))
            if not isinstance(exc, Exception):  # Ctrl-C or an exit where `run` is called: theirs to see
                raise
        finally:
            self._ready.set()  # (a worker that stopped before its decoder was made: closed by now)

    def _decoder(self) -> Any:
        decoder = self.runtime.batch_decoder()
        decoder.rows, decoder.reuse_prefixes = self.max_batch, self.prefix_reuse
        decoder.retain_tokens = self.prefix_cache_tokens if self.prefix_reuse else 0
        if self.sequence_tokens:
            decoder.sequence_tokens = min(self.sequence_tokens, self.runtime.context_length)
        limit = getattr(decoder, "sequence_tokens", None)  # one request's room, where < the context
        self.request_tokens = min(limit, self.runtime.context_length) if limit else None
        # the first decoder sets up its rows ahead (one made after a failed step would only make requests wait)
        if not self._ready.is_set():
            try:
                decoder.reserve(self.max_batch)
            except Exception:  # room set up ahead saves time only: without it rows take memory as they join
                log.warning("could not set up KV rows ahead of the first request", exc_info=True)
        return decoder

    def _serve(self, running: dict[int, _Running]) -> None:
        decoder = self._decoder()
        self._ready.set()
        filling: list[Filling] = []  # prompts joining in slices, first come first fed
        while True:
            with self._wake:
                while not self._queue and not running and not filling and not self._closed:
                    self._wake.wait()
                if self._closed and not self._queue and not running and not filling:
                    return
                joining = self._admissible(decoder, running, filling)
                self._wake.notify_all()  # the queue changed (see `wait_for`)
            calls = decoder.steps
            for request in joining:
                if self._fills(decoder, request):
                    self._open(decoder, filling, request)
                else:
                    self._admit(decoder, running, request)
            try:
                if filling:
                    self._step_filling(decoder, running, filling)
                elif running:
                    self._step(decoder, running)
            except Exception as exc:  # a failed step ends the requests it carried, never the worker
                log.exception("engine step failed")
                for request in [*(item.request for item in running.values()), *(f.request for f in filling)]:
                    self._end(request, ("error", f"generation failed: {_first_line(exc)}"))
                running.clear()
                filling.clear()
            self.steps += decoder.steps - calls
            if self.metrics:
                self.metrics.engine_calls(decoder.steps - calls)
            if not running and not filling and decoder.active:  # a failed step may have left sequences behind
                decoder = self._decoder()

    def _open(self, decoder: Any, filling: list[Filling], request: GenerationRequest) -> None:
        if request.cancelled.is_set():
            self._end(request, ("done", "cancelled"))
            return
        if self.metrics:
            self.metrics.queue_wait(time.monotonic() - request.queued_at)
        try:
            sequence, held = decoder.open(request.prompt)
            filling.append(Filling(request, sequence, held))
        except Exception as exc:
            log.exception("a request failed joining")
            self._end(request, ("error", f"generation failed: {_first_line(exc)}"))

    def _step_filling(self, decoder: Any, running: dict[int, _Running], filling: list[Filling]) -> None:
        """Every running sequence's next token and the next slices of the joining prompts, first come first fed,
        as many as the step's token budget holds: one engine call (llama.cpp) or one per slice right after the
        step (ONNX; the time counts as decode while requests run), each call's tokens sent as soon as it is done
        (`stream_step`). A prompt's last slice gives its request the first token; from then on it runs with the
        others."""
        for item in [f for f in filling if f.request.cancelled.is_set()]:
            decoder.remove(item.sequence)
            filling.remove(item)
            self._end(item.request, ("done", "cancelled"))
        for sequence in [s for s, item in running.items() if item.request.cancelled.is_set()]:
            decoder.remove(sequence)
            self._end(running.pop(sequence).request, ("done", "cancelled"))
        if not filling:
            if running:
                self._step(decoder, running)
            return
        budget, fills = self.step_tokens - len(running), []
        for item in filling:
            size = min(self._slice(item), budget)
            if size <= 0:
                break
            prompt = item.request.prompt
            fills.append((item, prompt[item.fed : item.fed + size], item.fed + size == len(prompt)))
            budget -= size
        decoding, engine_s = len(running), 0.0
        parts = decoder.stream_step(
            {s: item.last for s, item in running.items()},
            [(f.sequence, chunk, last) for f, chunk, last in fills],
        )
        sliced = {item.sequence: (item, chunk, last) for item, chunk, last in fills}
        while True:  # each part's tokens go out before the decoder's next call runs
            started = time.perf_counter()
            part = next(parts, None)
            engine_s += time.perf_counter() - started  # the engine's time only, not the sending
            if part is None:
                break
            stepped, filled = part
            for sequence, row in stepped.items():
                try:
                    self._emit(decoder, running, sequence, row)
                except Exception as exc:
                    log.exception("a request failed choosing its token")
                    self._drop(decoder, running, sequence, running[sequence].request, exc)
            for sequence, logits in filled.items():
                self._filled(decoder, running, filling, sliced[sequence], logits)
        if self.metrics:
            self.metrics.engine_seconds("decode" if decoding else "prefill", engine_s)
            if decoding:
                self.metrics.batch(decoding)

    def _filled(self, decoder: Any, running: dict, filling: list, fill: tuple, logits: Any) -> None:
        """A slice (`fill`: the filling item, its chunk, whether it is the last) of a prompt is in the cache; after
        the last one, the request runs with the others and gets its first token from `logits` (a failure of either
        ends this request only)."""
        item, chunk, last = fill
        item.fed += len(chunk)
        if not last:
            return
        filling.remove(item)
        try:
            rng = np.random.default_rng(item.request.sampling.seed)
        except Exception as exc:
            log.exception("a request failed choosing its token")
            decoder.remove(item.sequence)
            self._end(item.request, ("error", f"generation failed: {_first_line(exc)}"))
            return
        running[item.sequence] = _Running(item.request, rng)
        try:
            self._emit(decoder, running, item.sequence, logits)
        except Exception as exc:
            log.exception("a request failed choosing its token")
            self._drop(decoder, running, item.sequence, item.request, exc)

    def _admit(self, decoder: Any, running: dict[int, _Running], request: GenerationRequest) -> None:
        """Run a newcomer's prompt and pick its first token; a failure ends this request only."""
        if request.cancelled.is_set():
            self._end(request, ("done", "cancelled"))
            return
        if self.metrics:
            self.metrics.queue_wait(time.monotonic() - request.queued_at)
        sequence = None
        try:
            rng = np.random.default_rng(request.sampling.seed)
            started = time.perf_counter()
            if request.prompt_logprobs:  # the forward pass `score` makes, on this thread that owns the engine
                scores = prompt_scores(
                    self.runtime.position_logits(request.prompt),
                    request.prompt,
                    request.sampling.top_logprobs,
                )
                request.on_event(("prompt", scores))
            if request.max_tokens == 0:  # scoring only (OpenAI's echo with max_tokens 0)
                self._end(request, ("done", "length"))
                return
            sequence, logits = decoder.add(request.prompt)
            if self.metrics:
                self.metrics.engine_seconds("prefill", time.perf_counter() - started)
            running[sequence] = _Running(request, rng)
            self._emit(decoder, running, sequence, logits)
        except Exception as exc:
            log.exception("a request failed on its prompt")
            self._drop(decoder, running, sequence, request, exc)

    def _step(self, decoder: Any, running: dict[int, _Running]) -> None:
        for sequence in [s for s, item in running.items() if item.request.cancelled.is_set()]:
            decoder.remove(sequence)  # before the step: a cancelled request costs no more engine work
            self._end(running.pop(sequence).request, ("done", "cancelled"))
        if not running:
            return
        started = time.perf_counter()
        if self._speculates(decoder, running):
            self._speculative_step(decoder, running)
            if self.metrics:
                self.metrics.engine_seconds("decode", time.perf_counter() - started)
            return
        stepped = decoder.step({s: item.last for s, item in running.items()})
        if self.metrics:
            self.metrics.engine_seconds("decode", time.perf_counter() - started)
            self.metrics.batch(len(running))  # the histogram's sum counts every decoded token
        for sequence, logits in stepped.items():
            try:
                self._emit(decoder, running, sequence, logits)
            except Exception as exc:  # e.g. a sampling failure: this request ends, its neighbours go on
                log.exception("a request failed choosing its token")
                self._drop(decoder, running, sequence, running[sequence].request, exc)

    def _drop(
        self, decoder: Any, running: dict, sequence: int | None, request: GenerationRequest, exc: Exception
    ) -> None:
        if sequence is not None and running.pop(sequence, None) is not None:
            decoder.remove(sequence)
        self._end(request, ("error", f"generation failed: {_first_line(exc)}"))

    def _emit(self, decoder: Any, running: dict[int, _Running], sequence: int, logits: np.ndarray) -> None:
        """Pick and send the sequence's next token; retire the sequence when it is finished."""
        item = running[sequence]
        request = item.request
        finish = "cancelled" if request.cancelled.is_set() else None
        if finish is None:
            sampling = request.sampling
            chosen_from = adjusted_logits(logits, sampling, request.prompt, item.generated, request.stop_ids)
            token = choose_token(chosen_from, sampling, item.rng)
            item.last, item.produced = token, item.produced + 1
            item.generated.append(token)
            top = top_logprobs(logits, sampling.top_logprobs) if sampling.top_logprobs else None
            reported = logprob(logits, token) if request.token_logprobs else None
            request.on_event(("token", (token, reported, top)))
            if token in request.stop_ids:
                finish = "stop"
            elif item.produced >= request.max_tokens:
                finish = "length"
        if finish is not None:
            decoder.remove(sequence)
            del running[sequence]
            self._end(request, ("done", finish))

    def _end(self, request: GenerationRequest, event: tuple[str, Any]) -> None:
        """Send a request's last event, once (a request that already ended is left alone)."""
        with self._wake:
            if request.ended:
                return
            request.ended = True
            self.in_flight -= 1
            self._wake.notify_all()
        try:
            request.on_event(event)
        except Exception:  # the receiver is gone (its event loop closed): nothing left to tell
            log.debug("a finished request's receiver is gone", exc_info=True)


def _first_line(exc: BaseException) -> str:
    """What a client is told of a failure: the first line of its message. Engines append their own stack (or a
    worker's traceback) to it; that stays in the server log, beside ours."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]

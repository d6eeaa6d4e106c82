"""What the server promises beyond each answer, on the tiny model over loopback: a client that leaves mid-stream
stops the engine's work for its row, /ready follows the model's worker, and an internal failure is a 500 with a
one-line message in the route's own error shape while the server goes on answering."""

from __future__ import annotations

import collections
import json
import threading
import time

import httpx
import pytest

from serving.models import LoadedModel
from serving.scheduler import Scheduler
from tasks.config import ServeConfig
from tests.model.test_serving_app import PROMPT, live_server
from tests.model.test_serving_limits import complete

# What engines that run elsewhere (a tensor-parallel rank, a worker process) raise: their own traceback appended.
REMOTE_FAILURE = (
    "rank 1 lost its device\n"
    "Traceback (most recent call last):\n"
    '  File "engine/worker.py", line 42, in step\n'
    "RuntimeError: CUDA error: an illegal memory access was encountered"
)


class WatchedDecoder:
    """The real batch decoder, its calls recorded: the sequences added, the steps each one took part in and
    the sequences removed. A step waits while its runtime's `steps_allowed` is clear and raises its
    `step_error` (once) instead of stepping, as an engine that loses its device would."""

    def __init__(self, decoder, owner: WatchedRuntime) -> None:
        self._decoder, self._owner = decoder, owner
        self.added: list[int] = []
        self.stepped: collections.Counter[int] = collections.Counter()
        self.removed: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._decoder, name)  # `steps`, `active`: the real decoder's

    def add(self, prompt: list[int]):
        sequence, logits = self._decoder.add(prompt)
        self.added.append(sequence)
        return sequence, logits

    def step(self, tokens: dict[int, int]):
        assert self._owner.steps_allowed.wait(60), "the test never let the engine step"
        if (error := self._owner.step_error) is not None:
            self._owner.step_error = None
            raise error
        self.stepped.update(tokens.keys())
        return self._decoder.step(tokens)

    def remove(self, sequence: int) -> None:
        self.removed.append(sequence)
        self._decoder.remove(sequence)


class WatchedRuntime:
    """The real runtime whose batch decoders are `WatchedDecoder`s; `decoder_error` makes the next new decoder
    fail (an engine that cannot start again), `encode_error` the tokenizer (a failure in the handler itself)."""

    def __init__(self, runtime) -> None:
        self.runtime, self.decoders = runtime, []
        self.steps_allowed = threading.Event()
        self.steps_allowed.set()
        self.step_error: Exception | None = None
        self.decoder_error: Exception | None = None
        self.encode_error: Exception | None = None

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def encode(self, text: str) -> list[int]:
        if self.encode_error is not None:
            raise self.encode_error
        return self.runtime.encode(text)

    def batch_decoder(self) -> WatchedDecoder:
        if self.decoder_error is not None:
            raise self.decoder_error
        decoder = WatchedDecoder(self.runtime.batch_decoder(), self)
        self.decoders.append(decoder)
        return decoder


def record_submissions(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list:
    """The requests the HTTP layer hands `scheduler`, in order (submitted as before)."""
    submitted = []
    submit = scheduler.submit

    def recorded(request) -> None:
        submitted.append(request)
        submit(request)

    monkeypatch.setattr(scheduler, "submit", recorded)
    return submitted


def eventually(condition, what: str, timeout_s: float = 30) -> None:
    """Poll `condition` until it holds (for what notifies nobody, such as a worker thread's death)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent-events body, JSON decoded ("[DONE]" kept as is)."""
    payloads = [
        line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")
    ]
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


def test_a_client_that_disconnects_mid_stream_stops_the_engine_stepping_its_row(
    baseline_runtime, monkeypatch
):
    watched, budget = WatchedRuntime(baseline_runtime), 400  # a budget far beyond the tokens it is allowed
    with live_server(watched, ServeConfig(max_new_tokens=budget)) as (url, served):
        scheduler = served.current.scheduler
        submitted = record_submissions(scheduler, monkeypatch)
        watched.steps_allowed.clear()  # the row gets its first token from its prompt, then its next step waits
        body = {"prompt": PROMPT, "max_tokens": budget, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
            first = json.loads(next(stream.iter_lines()).removeprefix("data: "))
        # leaving the block closed the connection with ~400 tokens still to come
        (request,) = submitted
        assert first["choices"][0]["finish_reason"] is None
        assert request.cancelled.wait(30), "the server never cancelled the request of the client that left"
        watched.steps_allowed.set()
        assert scheduler.wait_for(lambda s: s.in_flight == 0, 30), "the cancelled request never ended"
        (decoder,) = watched.decoders
        (sequence,) = decoder.added
        assert decoder.stepped[sequence] <= 1  # at most the step that was waiting when the client left
        assert decoder.removed == [sequence] and decoder.active == 0


def test_ready_is_503_while_a_models_worker_is_down_and_200_once_a_new_version_serves(baseline_runtime):
    watched = WatchedRuntime(baseline_runtime)
    with live_server(watched, ServeConfig(max_new_tokens=8)) as (url, served):
        assert httpx.get(f"{url}/ready").json() == {"ready": True, "not_ready": []}
        watched.step_error = RuntimeError("device lost")
        watched.decoder_error = RuntimeError("device lost")  # the worker cannot start a new decoder: it stops
        failed = complete(url, key=None)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        eventually(lambda: httpx.get(f"{url}/ready").status_code == 503, "/ready to report the worker down")
        assert httpx.get(f"{url}/ready").json() == {"ready": False, "not_ready": ["tiny/3"]}
        refused = complete(url, key=None)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "unavailable"
        assert httpx.get(f"{url}/health").status_code == 200  # alive: it answers, a new version can come

        # what the alias watcher does when production moves: the new version's own worker takes over
        served.swap(LoadedModel("4", baseline_runtime, Scheduler(baseline_runtime, max_batch=8, max_queue=8)))
        assert httpx.get(f"{url}/ready").json() == {"ready": True, "not_ready": []}
        answer = complete(url, key=None)
        assert answer.status_code == 200 and answer.json()["model"] == "tiny/4"


def test_a_failure_in_a_handler_is_a_500_with_a_one_line_message_and_the_server_goes_on(
    baseline_runtime, caplog
):
    watched = WatchedRuntime(baseline_runtime)
    with live_server(watched, ServeConfig(max_new_tokens=8)) as (url, _):
        watched.encode_error = ValueError(REMOTE_FAILURE)  # a tokenizer that breaks on this text
        failed = complete(url, key=None)
        watched.encode_error = None
        assert failed.status_code == 500
        assert failed.json() == {
            "error": {
                "message": "internal error (ValueError); see the server log",
                "type": "server_error",
                "code": 500,
            }
        }
        assert complete(url, key=None).status_code == 200
    assert REMOTE_FAILURE in caplog.text  # the whole story is in the server log


ONE_LINE = "generation failed: rank 1 lost its device"  # what a client is told of REMOTE_FAILURE
OPENAI_ERROR = {"error": {"message": ONE_LINE, "type": "server_error", "code": 500}}
TGI_ERROR = {"error": ONE_LINE, "error_type": "generation"}
# Per route: path, body, status, and the error as the route promises it, in its API's own shape: before an answer
# starts, a 500; once a stream has started, its last events.
ROUTES = {
    "openai": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8}, 500, OPENAI_ERROR),
    "openai-stream": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "stream": True},
        200,
        [OPENAI_ERROR, "[DONE]"],
    ),
    "tgi": ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}, 500, TGI_ERROR),
    "tgi-stream": (
        "/generate_stream",
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}},
        200,
        [TGI_ERROR],
    ),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_engine_failure_is_one_line_in_the_routes_error_shape_and_the_server_goes_on(
    route, baseline_runtime, caplog
):
    path, body, status, expected = ROUTES[route]
    watched = WatchedRuntime(baseline_runtime)
    with live_server(watched, ServeConfig(max_new_tokens=8)) as (url, _):
        watched.step_error = RuntimeError(REMOTE_FAILURE)  # the first step, after the prompt's token
        failed = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert failed.status_code == status
        sent = sse_events(failed)[-len(expected) :] if isinstance(expected, list) else failed.json()
        assert sent == expected
        again = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert again.status_code == 200 and '"error"' not in again.text
    assert REMOTE_FAILURE in caplog.text  # the engine's whole story stays in the server log

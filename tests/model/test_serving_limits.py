"""What the server refuses, and that it keeps answering after each refusal; how it batches concurrent requests."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tasks.config import ServeConfig, TargetConfig
from tasks.engines import Runtime, load_runtime
from tests.model.test_serving_app import PROMPT, live_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def onnx_runtime(tiny_engine_dir) -> Runtime:
    return load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1))


@pytest.fixture(scope="module")
def llama_runtime(tiny_engine_dir) -> Runtime:
    return load_runtime(tiny_engine_dir("llama.cpp"), TargetConfig(threads=1))


@pytest.fixture(scope="module")
def runtime_torch(baseline_dir) -> Runtime:
    return load_runtime(baseline_dir, TargetConfig(threads=1))


class GatedRuntime:
    """The real runtime, except that its decoder runs no prompt while `gate` is closed: lets a test hold the
    engine busy (queue full, timeouts) or let requests pile up before they batch, without sleeps."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.gate, self.decoders = runtime, threading.Event(), []

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def batch_decoder(self):
        decoder = self.runtime.batch_decoder()
        for name in ("add", "stream_step"):  # the calls that run prompts (whole, or in slices)
            setattr(decoder, name, self._gated(getattr(decoder, name)))
        self.decoders.append(decoder)
        return decoder

    def _gated(self, run):
        def gated(*args):
            assert self.gate.wait(60), "test gate never opened"
            return run(*args)

        return gated


def complete(url: str, key: str | None = KEY, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=60)


def test_each_refusal_names_its_cause_and_the_server_still_answers(onnx_runtime, monkeypatch):
    monkeypatch.setenv("LLMOPT_TEST_KEY", KEY)
    settings = ServeConfig(
        max_new_tokens=8,
        max_batch=1,
        max_queue=1,
        request_timeout_s=1.0,
        max_body_kb=4,
        api_key_env="LLMOPT_TEST_KEY",
    )
    gated = GatedRuntime(onnx_runtime)
    gated.gate.set()
    with live_server(gated, settings) as (url, served):

        def still_answers() -> None:
            assert complete(url).status_code == 200

        assert complete(url, key=None).status_code == 401
        assert complete(url, key="wrong").json()["error"]["type"] == "authentication_error"
        still_answers()
        missing = complete(url, model="nope")
        assert missing.status_code == 404 and "served: tiny/3" in missing.json()["error"]["message"]
        still_answers()
        for bad in (
            {"n": 9},
            {"bogus": 1},
            {"max_tokens": 0},
            {"prompt": ""},
            {"temperature": -1},
            {"seed": -1},
        ):
            assert complete(url, **bad).status_code == 422, bad
        still_answers()
        long_prompt = " ".join(["the river walks the stone"] * 120)  # under the body limit, over the context
        overflow = complete(url, prompt=long_prompt, max_tokens=8)
        tokens = len(onnx_runtime.encode(long_prompt))
        message = overflow.json()["error"]["message"]
        assert (
            overflow.status_code == 400
            and f"prompt ({tokens} tokens) + max_tokens (8)" in message
            and "512" in message
        )
        assert complete(url, prompt="x" * 5000).status_code == 413
        chunked = httpx.post(  # no Content-Length: the limit is enforced while the body streams in
            f"{url}/v1/completions",
            content=iter([b"{" + b" " * 3000] * 3),
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "too_large"
        still_answers()

        gated.gate.clear()  # the engine is now busy with the first request: one more queues, the next is refused
        scheduler = served.current.scheduler
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(complete, url)
            assert scheduler.wait_for(lambda s: s.in_flight == 1 and s.queued == 0, 30), (
                "first never reached the engine"
            )
            queued = pool.submit(complete, url)
            assert scheduler.wait_for(lambda s: s.queued == 1, 30), "the second request never queued"
            refused = complete(url)
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            timed_out = running.result()  # the gate stays closed past serve.request_timeout_s
            assert (
                timed_out.status_code == 504 and "request_timeout_s" in timed_out.json()["error"]["message"]
            )
            assert queued.result().status_code == 504
        gated.gate.set()
        still_answers()
        metrics = httpx.get(f"{url}/metrics").text
        assert 'llmopt_requests_total{route="/v1/completions",status="429"} 1.0' in metrics
        assert 'llmopt_requests_total{route="/v1/completions",status="504"} 2.0' in metrics


@pytest.mark.parametrize("engine", ["onnx_runtime", "llama_runtime"])
def test_concurrent_requests_batch_into_fewer_engine_calls_with_the_answers_they_get_alone(engine, request):
    runtime = request.getfixturevalue(engine)  # engines that step sequences of different lengths together
    ids = runtime.encode(PROMPT + " The train finds the book near the quiet forest 7.")
    requests = [
        (ids[:n], m) for n, m in ((3, 8), (9, 5), (14, 8), (5, 2), (20, 7))
    ]  # lengths and budgets differ
    alone = [runtime.generate([prompt], budget)[0] for prompt, budget in requests]
    gated = GatedRuntime(runtime)
    with live_server(gated, ServeConfig(max_new_tokens=8, max_batch=8)) as (url, served):

        def ask(request) -> dict:
            prompt, budget = request
            text = runtime.decode(prompt)
            return complete(url, key=None, prompt=text, max_tokens=budget).json()

        with ThreadPoolExecutor(len(requests)) as pool:
            answers = [pool.submit(ask, request) for request in requests]
            reached = served.current.scheduler.wait_for(lambda s: s.in_flight == len(requests), 30)
            assert reached, "not every request reached the server"
            gated.gate.set()
            answers = [answer.result() for answer in answers]
        calls = gated.decoders[0].steps
    sequential = sum(
        1 + (len(tokens) - 1) for tokens in alone
    )  # a prompt call, then one step per later token
    assert calls < sequential
    for answer, tokens, (prompt, _) in zip(answers, alone, requests, strict=True):
        assert runtime.encode(runtime.decode(prompt)) == prompt  # the text round-trips to these ids
        assert answer["choices"][0]["text"] == runtime.decode(tokens)
        assert answer["usage"]["completion_tokens"] == len(tokens)


def test_a_cancelled_request_stops_at_the_next_step_and_frees_its_slot(onnx_runtime):
    from serving.sampling import Sampling
    from serving.scheduler import GenerationRequest, Scheduler

    scheduler = Scheduler(onnx_runtime, max_batch=2, max_queue=4)
    events, ended = [], threading.Event()

    def on_event(event) -> None:
        events.append(event)
        if event[0] == "token" and len(events) == 3:
            request.cancel()  # as the HTTP layer does when the client goes away or a stop string appears
        if event[0] == "done":
            ended.set()

    request = GenerationRequest(onnx_runtime.encode(PROMPT), 400, Sampling(), on_event)
    scheduler.submit(request)
    assert ended.wait(30)
    scheduler.close()
    assert events[-1] == ("done", "cancelled") and len(events) == 4  # three tokens, then the end
    assert scheduler.in_flight == 0 and scheduler.steps == 3  # the prompt call and two steps: nothing after


def test_one_server_routes_each_request_to_the_model_it_names(onnx_runtime, runtime_torch):
    from fastapi.testclient import TestClient

    from serving.app import create_app
    from serving.in_process import serve_runtime
    from serving.models import ModelRouter

    settings = ServeConfig(max_new_tokens=4)
    router = ModelRouter(
        [
            serve_runtime(onnx_runtime, "tiny", "3", settings),
            serve_runtime(runtime_torch, "tiny", "1", settings),
        ]
    )
    with TestClient(create_app(router, settings)) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert listed == ["tiny/3", "tiny/1"]
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json={**body, "model": "tiny/1"}).json()["model"] == "tiny/1"
        assert client.post("/v1/completions", json=body).json()["model"] == "tiny/3"  # none named: the first
        assert [m["engine"] for m in client.get("/health").json()["models"]] == ["onnxruntime-genai", "torch"]


def test_a_request_failing_in_the_worker_ends_alone_and_its_neighbours_finish(onnx_runtime):
    from serving.sampling import Sampling
    from serving.scheduler import GenerationRequest, Scheduler

    prompt = onnx_runtime.encode(PROMPT)
    gated = GatedRuntime(onnx_runtime)
    scheduler = Scheduler(gated, max_batch=4, max_queue=4)
    events: dict[str, list] = {"good": [], "bad": []}
    ended = threading.Semaphore(0)

    def collect(name):
        def on_event(event):
            events[name].append(event)
            if event[0] in ("done", "error"):
                ended.release()

        return on_event

    good = GenerationRequest(prompt, 6, Sampling(), collect("good"))
    bad = GenerationRequest(
        prompt, 6, Sampling(temperature=1.0, seed=-1), collect("bad")
    )  # its RNG cannot start
    scheduler.submit(good)
    scheduler.submit(bad)
    gated.gate.set()
    assert ended.acquire(timeout=30) and ended.acquire(timeout=30)
    scheduler.close()
    assert [kind for kind, _ in events["bad"]] == ["error"]
    assert [value[0] for kind, value in events["good"] if kind == "token"] == onnx_runtime.generate(
        [prompt], 6
    )[0]
    assert events["good"][-1][0] == "done" and scheduler.in_flight == 0 and gated.decoders[0].active == 0


class _Recording:
    """The runtime, recording the thread of every `encode` call."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.threads = runtime, []

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def encode(self, text: str) -> list[int]:
        self.threads.append((len(text), threading.current_thread().name))
        return self.runtime.encode(text)


def test_abusive_prompts_are_refused_unread_or_tokenized_off_the_event_loop_and_slow_bodies_time_out(
    onnx_runtime, monkeypatch
):
    """A prompt longer than any tokenization could fit (characters ÷ the longest vocabulary entry) is a 400 before
    any tokenizing; a long prompt that may fit is tokenized on the server's tokenizer thread, never on the event
    loop that streams every other answer; a body still incomplete after serve.body_timeout_s is a 408."""
    import socket
    import time

    from serving.text import longest_token_chars

    monkeypatch.setattr(
        "serving.text.INLINE_CHARS", 16
    )  # the tiny model's context holds no 4096-character prompt
    assert len(PROMPT) > 16
    recording = _Recording(onnx_runtime)
    longest = longest_token_chars(onnx_runtime.tokenizer)
    context = onnx_runtime.context_length
    settings = ServeConfig(max_new_tokens=8, max_body_kb=64 * 1024, body_timeout_s=1.0)
    with live_server(recording, settings) as (url, _):
        huge = "w " * ((context * longest) // 2 + 8)  # at least context + 8 tokens, however it is cut
        refused = complete(url, key=None, prompt=huge, max_tokens=8)
        assert refused.status_code == 400 and "at least" in refused.json()["error"]["message"]
        assert all(length != len(huge) for length, _ in recording.threads)  # never tokenized
        short = "The river"  # under INLINE_CHARS (16 here): tokenized where the request is handled
        assert complete(url, key=None, prompt=PROMPT, max_tokens=2).status_code == 200
        assert complete(url, key=None, prompt=short, max_tokens=2).status_code == 200
        threads = dict(recording.threads)
        assert threads[len(PROMPT)].startswith("llmopt-tokenize")
        assert not threads[len(short)].startswith("llmopt-tokenize")
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt":'
            )
            started = time.monotonic()
            slow.settimeout(30)
            answer = b""
            while b"body_timeout_s" not in answer and (chunk := slow.recv(4096)):
                answer += chunk
            answer = answer.decode()
            assert answer.startswith("HTTP/1.1 408") and "serve.body_timeout_s" in answer
            assert 0.9 < time.monotonic() - started < 20
        assert complete(url, key=None).status_code == 200  # and it still answers


def test_serving_beyond_loopback_without_an_api_key_is_warned_about():
    from serving.app import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("10.1.2.3") and not _loopback("my-host")


def test_a_stream_outlives_the_body_deadline(onnx_runtime):
    """serve.body_timeout_s bounds reading the request body only: a streamed answer that waits in the queue and
    streams for longer still ends whole (the server's disconnect listener reads on while it streams)."""
    import time

    gated = GatedRuntime(onnx_runtime)
    with live_server(gated, ServeConfig(max_new_tokens=8, body_timeout_s=0.5)) as (url, _):
        payload = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
        lines: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as response:
                assert response.status_code == 200
                lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1.5)  # past the body deadline, the request still waiting for the engine
        gated.gate.set()
        reader.join(timeout=60)
        assert lines and lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines


def test_llama_cpp_serves_each_sequence_in_a_stream_of_its_own_and_refuses_what_a_stream_cannot_hold(
    llama_runtime, monkeypatch
):
    """The server's llama.cpp decoder gives each of its `max_batch` rows a KV stream of its own (a token attends
    over its own sequence's cells only; finished ones are kept as copies in memory, not in streams); a request
    longer than a stream is a 400 naming the room, /info says it, and the server goes on."""
    from tasks.engines.llama_cpp import batch

    monkeypatch.setattr(batch, "STREAM_TOKENS", 256)  # the tiny model's context is 512
    gated = GatedRuntime(llama_runtime)
    gated.gate.set()
    settings = ServeConfig(max_new_tokens=64, max_batch=3, prefix_cache_tokens=100_000)
    with live_server(gated, settings) as (url, _):
        context = gated.decoders[0]._context
        assert not context.unified and context.sequences == 3 and context.cells == 3 * 256

        def ask(prompt_tokens: int) -> httpx.Response:
            body = {"prompt": [5] * prompt_tokens, "max_tokens": 64, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        refused = ask(200)
        assert refused.status_code == 400, refused.text
        assert "exceeds the server's room per request of 256 tokens" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/info", timeout=60).json()["max_total_tokens"] == 256
        assert ask(150).status_code == 200

"""`llmopt serve` stopped with SIGTERM (what a deploy or an orchestrator sends) while a stream is in flight: it
refuses new connections at once, the stream still gets every token, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest
import yaml

from tests.integration import test_hot_swap
from tests.integration.project import project_env
from tests.model.test_serving_app import PROMPT

registry_project = test_hot_swap.registry_project  # the fixture: the tiny model registered, production on v1
BUDGET = 480  # tokens: with the prompt, about the tiny model's whole context; ~1 s of decoding to drain


@pytest.mark.slow
def test_sigterm_refuses_new_connections_lets_the_running_stream_finish_and_exits_0(registry_project):
    root = registry_project[0]
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["serve"].update(max_new_tokens=BUDGET, watch_s=0)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    port, log_file = test_hot_swap._free_port(), root / "serve.log"
    server = subprocess.Popen(
        ["llmopt", "serve", "--port", str(port)],
        cwd=root,
        env=project_env(root),
        stdout=log_file.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    body = {
        "prompt": PROMPT,
        "max_tokens": BUDGET,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        test_hot_swap._wait_for_health(server, url, log_file)
        whole = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60).json()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            server.send_signal(signal.SIGTERM)
            refused_while_draining = _refused(port) and server.poll() is None
            events = [first, *lines]
        exit_code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    log = log_file.read_text(errors="replace")

    assert refused_while_draining, log
    assert "Waiting for connections to close" in log  # the stream was still running when the server stopped
    payloads = [line.removeprefix("data: ") for line in events if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == BUDGET
    streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
    assert streamed == whole["choices"][0]["text"]  # every token, as the same request gets it undisturbed
    assert exit_code == 0, log


def _refused(port: int, timeout_s: float = 10) -> bool:
    """Whether connecting to `port` is refused within `timeout_s` (polled: a listener closing notifies nobody)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        time.sleep(0.02)
    return False

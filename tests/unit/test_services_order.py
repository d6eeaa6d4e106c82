"""`llmopt services up|down` start independent services together and each dependent one only once what it needs
answers; they stop in the reverse order. Real background processes (small HTTP servers behind a shell script)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flows.services import Service, healthy, start_all, stop_all
from tasks.errors import ServiceError

SCRIPT = """#!/bin/bash
echo "$NAME start $(date +%s.%N)" >> "$EVENTS"
trap 'echo "$NAME stop $(date +%s.%N)" >> "$EVENTS"; kill $child; exit 0' TERM
[ "$FAIL" = 1 ] && exit 3
sleep "$DELAY"
python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$FOLDER" >/dev/null 2>&1 &
child=$!
wait $child
"""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _service(folder: Path, name: str, after: tuple[str, ...] = (), delay: float = 1.0, fail: bool = False):
    script = folder / "serve.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    port = _port()
    env = {
        "NAME": name,
        "EVENTS": str(folder / "events"),
        "DELAY": str(delay),
        "PORT": str(port),
        "FOLDER": str(folder),
        "FAIL": "1" if fail else "0",
    }
    return Service(name, script, f"http://127.0.0.1:{port}/", env, folder, after)


def _events(folder: Path) -> dict[tuple[str, str], float]:
    lines = (line.split() for line in (folder / "events").read_text().splitlines())
    return {(name, what): float(when) for name, what, when in lines}


def test_independent_services_start_together_and_a_dependent_one_after_what_it_needs(tmp_path):
    server, store = _service(tmp_path, "server"), _service(tmp_path, "store")
    worker = _service(tmp_path, "worker", after=("server", "store"), delay=0)
    lines: list[str] = []
    try:
        start_all([server, store, worker], lines.append)
        assert all(healthy(s) for s in (server, store, worker))
    finally:
        stop_all([server, store, worker], lines.append)
    events = _events(tmp_path)
    assert (
        abs(events["server", "start"] - events["store", "start"]) < 0.9
    )  # neither waited for the other's 1 s
    assert events["worker", "start"] > max(events["server", "start"], events["store", "start"]) + 0.9
    assert events["worker", "stop"] < min(events["server", "stop"], events["store", "stop"])  # stopped first
    assert sorted(line.split(":")[0] for line in lines) == [
        "server",
        "server",
        "store",
        "store",
        "worker",
        "worker",
    ]
    assert not any(healthy(s) for s in (server, store, worker))


def test_a_service_that_fails_to_start_is_named_and_what_needs_it_is_not_started(tmp_path):
    broken, other = _service(tmp_path, "database", fail=True), _service(tmp_path, "cache", delay=0)
    dependent = _service(tmp_path, "tracking", after=("database",), delay=0)
    lines: list[str] = []
    try:
        with pytest.raises(ServiceError, match=r"^database did not start") as failure:
            start_all([broken, other, dependent], lines.append)
        assert "tracking" not in str(failure.value)
        assert "tracking: not started (database failed)" in lines
        assert any(line.startswith("cache: started") for line in lines) and healthy(other)
        assert ("tracking", "start") not in _events(tmp_path)
    finally:
        stop_all([broken, other, dependent], lines.append)


def test_services_that_wait_for_each_other_are_refused_before_any_starts(tmp_path):
    first = _service(tmp_path, "first", after=("second",))
    second = _service(tmp_path, "second", after=("first",))
    with pytest.raises(ServiceError, match="services wait for each other: first, second"):
        start_all([first, second, _service(tmp_path, "other")], print)
    assert not (tmp_path / "events").exists()  # nothing was started

"""The project lock (tasks/project_lock.py) between real processes: the second writer waits and says for whom, then
gives up with a clear error; a dead holder's lease and a silent one are broken with a line saying so; a live holder
on another host is never broken; the CLI's writers take it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.project_lock import LEASE_S, LOCK_FILE, ProjectBusy, project_lock
from tests.integration.project import REPO, run

HOLD = """
import sys, time
from pathlib import Path
from tasks.project_lock import project_lock
with project_lock(Path(sys.argv[1]), "llmopt run"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it (or kills this process)
"""


def hold(workdir: Path) -> subprocess.Popen:
    """A process holding the project lock of `workdir` until its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_waits_saying_for_whom_then_gives_up_and_gets_it_once_released(tmp_path, monkeypatch):
    holder = hold(tmp_path)
    said: list[str] = []
    monkeypatch.setenv("LLMOPT_PROJECT_LOCK_WAIT_S", "1.5")
    started = time.monotonic()
    busy = rf"the llmopt run started at .* by pid {holder.pid} on .* still holds"
    with pytest.raises(ProjectBusy, match=busy), project_lock(tmp_path, "llmopt promote", said.append):
        pass
    assert time.monotonic() - started >= 1.5
    assert (
        len(said) == 1
        and said[0].startswith("waiting for the llmopt run started at ")
        and str(holder.pid) in said[0]
    )
    holder.stdin.close()
    holder.wait(timeout=30)
    monkeypatch.setenv("LLMOPT_PROJECT_LOCK_WAIT_S", "30")
    with project_lock(tmp_path, "llmopt promote", said.append), project_lock(tmp_path, "the flow inside"):
        assert (
            json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        )  # taken, and again (no-op)
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_killed_holders_lease_is_broken_with_a_line_and_a_live_one_elsewhere_never_is(
    tmp_path, monkeypatch
):
    holder = hold(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    said: list[str] = []
    with project_lock(tmp_path, "llmopt run", said.append):
        pass
    assert len(said) == 1 and said[0].startswith("broke the project lock of the llmopt run started at ")
    assert said[0].endswith(f"its process {holder.pid} is gone")

    lease = {
        "command": "llmopt run",
        "pid": 1,
        "host": "another-host",
        "token": "t",
        "since": "2026-12-05T09:00:00+00:00",
    }
    (tmp_path / LOCK_FILE).write_text(json.dumps({**lease, "renewed": time.time() - 3 * LEASE_S}))
    said.clear()
    with project_lock(tmp_path, "llmopt run", said.append):
        pass
    assert len(said) == 1 and "its lease was not renewed for" in said[0] and "on another-host" in said[0]

    (tmp_path / LOCK_FILE).write_text(json.dumps({**lease, "renewed": time.time()}))  # alive, renewing
    monkeypatch.setenv("LLMOPT_PROJECT_LOCK_WAIT_S", "1")
    busy = "on another-host still holds the project lock"
    with pytest.raises(ProjectBusy, match=busy), project_lock(tmp_path, "llmopt run", said.append):
        pass
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "another-host"  # not broken


def test_the_cli_writers_wait_for_the_project_lock_and_stop_with_one_line(
    tmp_path, tiny_model_dir, corpus_dir
):
    from tests.integration.project import make_project, tiny_params

    root = make_project(tmp_path / "p", tiny_params(tiny_model_dir, corpus_dir), with_dvc=False)
    holder = hold(root / ".llmopt")
    try:
        env = {"LLMOPT_PROJECT_LOCK_WAIT_S": "2"}
        result = run(root, "llmopt", "rollback", "--reason", "test", check=False, env=env)
        assert result.returncode == 1, result.stderr
        assert "waiting for the llmopt run started at" in result.stderr
        assert f"by pid {holder.pid} on {socket.gethostname()} still holds the project lock" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_an_empty_lock_file_left_by_a_dead_writer_is_broken_and_a_quiet_live_holder_here_is_not(
    tmp_path, monkeypatch
):
    lock = tmp_path / LOCK_FILE
    lock.write_text("")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    said: list[str] = []
    with project_lock(tmp_path, "llmopt run", said.append):
        pass
    assert len(said) == 1 and "its file was unreadable" in said[0]

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # alive on this host, its lease not renewed for minutes (stopped, or blocked): still its lock
        lease = {"command": "llmopt run", "pid": sleeper.pid, "host": socket.gethostname(), "token": "q"}
        lock.write_text(
            json.dumps({**lease, "since": "2026-12-05T09:00:00+00:00", "renewed": time.time() - 600})
        )
        monkeypatch.setenv("LLMOPT_PROJECT_LOCK_WAIT_S", "1")
        with pytest.raises(ProjectBusy), project_lock(tmp_path, "llmopt run", said.append):
            pass
        assert json.loads(lock.read_text())["token"] == "q"
    finally:
        sleeper.kill()
        sleeper.wait()

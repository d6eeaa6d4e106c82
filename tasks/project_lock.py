"""The project lock: one writer of a project's shared state at a time (`llmopt run`, a schedule tick, `promote`,
`rollback`, `bench`: the variant folders, the evaluation cache, the registry, DVC's lock).

A lease file, `<project.workdir>/project.lock`, created exclusively (O_EXCL) and renewed by its holder every
`LEASE_S / 3` seconds. A second process waits, saying once for whom (`waiting for the run started at … by pid … on
…`), up to `LLMOPT_PROJECT_LOCK_WAIT_S` (default 1800 s), then stops with a clear error. A lease whose holder ran on
this host and whose process is gone, or one not renewed for `LEASE_S` (a holder elsewhere that went silent), is
broken with a line saying so; a live holder on another host renews its lease and is never broken. The same process
may take it again (a flow inside a command that holds it).

Lock order: the project lock, then the registry lock of a production move (tasks/decide/history.py); never the
other way round.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tasks.errors import LlmoptError

LOCK_FILE = "project.lock"
LEASE_S = 30.0
WAIT_ENV = "LLMOPT_PROJECT_LOCK_WAIT_S"
DEFAULT_WAIT_S = 1800.0
_held: dict[Path, int] = {}  # lock path → how many times this process holds it


class ProjectBusy(LlmoptError):
    """Another process held the project lock for longer than this one would wait."""


@contextlib.contextmanager
def project_lock(workdir: Path, command: str, say: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the project lock for the body (see the module docstring)."""
    path = (workdir / LOCK_FILE).resolve()
    if _held.get(path):
        _held[path] += 1
        try:
            yield
        finally:
            _held[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    _acquire(path, command, token, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)), say)
    _held[path] = 1
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(path, token, stop), daemon=True, name="llmopt-lease")
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join(timeout=5)
        del _held[path]
        if (_read(path) or {}).get("token") == token:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _acquire(path: Path, command: str, token: str, wait_s: float, say: Callable[[str], None]) -> None:
    deadline, announced = time.monotonic() + wait_s, False
    while True:
        if _create(path, _lease(command, token)):
            return
        holder = _read(path)
        if holder is None:  # released, or being written: look again
            time.sleep(0.05)
            continue
        stale = _stale(holder)
        if stale is not None:
            if _break(path, holder):
                say(f"broke the project lock of the {_who(holder)}: {stale}")
            continue
        if not announced:
            say(f"waiting for the {_who(holder)} to finish (project lock {path})")
            announced = True
        if time.monotonic() > deadline:
            raise ProjectBusy(
                f"the {_who(holder)} still holds the project lock after {wait_s:g} s of waiting; try again when it "
                f"has finished (or set {WAIT_ENV} to wait longer)"
            )
        time.sleep(1.0)


def _lease(command: str, token: str) -> dict[str, Any]:
    now = time.time()
    return {
        "command": command,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "token": token,
        "since": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="seconds"),
        "renewed": now,
    }


def _create(path: Path, lease: dict[str, Any]) -> bool:
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as file:
        json.dump(lease, file)
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _stale(holder: dict[str, Any]) -> str | None:
    """Why a holder's lease may be broken (None: it may not)."""
    import psutil

    if holder.get("host") == socket.gethostname() and not psutil.pid_exists(int(holder.get("pid", 0))):
        return f"its process {holder.get('pid')} is gone"
    age = time.time() - float(holder.get("renewed", 0))
    if age > LEASE_S:
        return f"its lease was not renewed for {age:.0f} s"
    return None


def _break(path: Path, holder: dict[str, Any]) -> bool:
    """Remove the lease file if it is still `holder`'s (another process may have broken it and taken the lock)."""
    aside = path.with_name(f"{path.name}.broken-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if (_read(aside) or {}).get("token") != holder.get("token") and not path.exists():
        os.rename(aside, path)  # a new holder's lease, taken between our look and the rename: put it back
        return False
    aside.unlink(missing_ok=True)
    return True


def _renew(path: Path, token: str, stop: threading.Event) -> None:
    while not stop.wait(LEASE_S / 3):
        lease = _read(path)
        if lease is None or lease.get("token") != token:
            return  # broken by someone else: nothing of ours to renew
        fresh = path.with_name(f"{path.name}.{token[:8]}")
        fresh.write_text(json.dumps({**lease, "renewed": time.time()}))
        os.replace(fresh, path)


def _who(holder: dict[str, Any]) -> str:
    return (
        f"{holder.get('command', 'command')} started at {holder.get('since', '?')} by pid {holder.get('pid', '?')} "
        f"on {holder.get('host', '?')}"
    )

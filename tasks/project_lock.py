"""The project lock: one writer of a project's shared state at a time (`llmopt run`, a schedule tick, `promote`,
`rollback`, `bench`: the variant folders, the evaluation cache, the registry, DVC's lock).

A lease file, `<project.workdir>/project.lock`, created exclusively (O_EXCL) and renewed by its holder every
`LEASE_S / 3` seconds. A second process waits, saying once for whom (`waiting for the run started at … by pid … on
…`), up to `LLMOPT_PROJECT_LOCK_WAIT_S` (default 1800 s), then stops with a clear error. A lease whose holder ran on
this host and whose process is gone, or one not renewed for `LEASE_S` (a holder elsewhere that went silent), is
broken with a line saying so; a live holder on another host renews its lease and is never broken, nor is a live
process on this host however long it is quiet. The lock belongs to a process: its threads (a flow inside the command
that took it) take it again at no cost.

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
UNREADABLE_S = (
    5.0  # a lease file still unreadable (empty, cut short) after this long was left by a dead writer
)
_held: dict[Path, int] = {}  # lock path → how many times this process holds it
_held_lock = threading.Lock()


class ProjectBusy(LlmoptError):
    """Another process held the project lock for longer than this one would wait."""


@contextlib.contextmanager
def project_lock(workdir: Path, command: str, say: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the project lock for the body (see the module docstring)."""
    path = (workdir / LOCK_FILE).resolve()
    with _held_lock:
        again = _held.get(path, 0) > 0
        if again:
            _held[path] += 1
    if again:
        try:
            yield
        finally:
            with _held_lock:
                _held[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    _acquire(path, command, token, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)), say)
    with _held_lock:
        _held[path] = 1
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(path, token, stop), daemon=True, name="llmopt-lease")
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join(timeout=5)
        with _held_lock:
            _held.pop(path, None)
        if (_read(path) or {}).get("token") == token:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _acquire(path: Path, command: str, token: str, wait_s: float, say: Callable[[str], None]) -> None:
    deadline, announced = time.monotonic() + wait_s, False
    while True:
        if _create(path, _lease(command, token)):
            return
        holder = _read(path)
        if holder is None:  # released meanwhile, or a file its writer died before filling
            if _age(path) > UNREADABLE_S and _break(path, {}):
                say(f"broke the project lock {path}: its file was unreadable for {UNREADABLE_S:g} s")
            elif time.monotonic() > deadline:
                raise ProjectBusy(
                    f"the project lock {path} is unreadable; remove it if no llmopt command runs"
                )
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
    """Put the lease in place only if there is none: written whole under a name of its own, then linked (an atomic
    exclusive create: the lock file is never seen empty or half written)."""
    written = path.with_name(f"{path.name}.new-{lease['token'][:8]}")
    written.write_text(json.dumps(lease))
    try:
        os.link(written, path)
    except FileExistsError:
        return False
    finally:
        written.unlink(missing_ok=True)
    return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _stale(holder: dict[str, Any]) -> str | None:
    """Why a holder's lease may be broken (None: it may not)."""
    import psutil

    if holder.get("host") == socket.gethostname():  # this host can tell: only a process that is gone loses it
        if psutil.pid_exists(int(holder.get("pid", 0))):
            return None
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
    """Refresh the lease's time every LEASE_S / 3 while it is ours; a moment without a file (another process
    looking at it aside) or a failed write is tried again at the next turn."""
    while not stop.wait(LEASE_S / 3):
        lease = _read(path)
        if lease is None:
            continue
        if lease.get("token") != token:
            return  # broken, and taken by another: nothing of ours to renew
        fresh = path.with_name(f"{path.name}.{token[:8]}")
        try:
            fresh.write_text(json.dumps({**lease, "renewed": time.time()}))
            os.replace(fresh, path)
        except OSError:
            fresh.unlink(missing_ok=True)


def _who(holder: dict[str, Any]) -> str:
    return (
        f"{holder.get('command', 'command')} started at {holder.get('since', '?')} by pid {holder.get('pid', '?')} "
        f"on {holder.get('host', '?')}"
    )

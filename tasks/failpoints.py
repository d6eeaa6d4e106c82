"""Fail points: named places where a test makes llmopt fail at an exact moment instead of racing a timer.

`LLMOPT_FAILPOINT=<name>[:<action>]` acts when the process reaches `failpoint(<name>)`; unset (always, in normal
use) it costs one environment lookup. Actions:
- `kill` (the default): SIGKILL itself, as abruptly as a power cut or the OOM killer would;
- `stop`: SIGSTOP itself, so a test can act at exactly that moment (fill the disk, kill a server) and then resume
  it with SIGCONT;
- `oserror`: raise OSError, a transient I/O fault (a network, database or disk hiccup) that retries are for;
- `enospc`: raise OSError(ENOSPC), the disk full where the point is.
`LLMOPT_FAILPOINT_ONCE=<file>`: only the first process to get there acts (it creates the file), so a task retried
on another worker goes through. `LLMOPT_FAILPOINT_TIMES=<n>`: act on the first n hits in this process only (a
transient fault that clears after n tries).
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "LLMOPT_FAILPOINT"
ONCE_ENV = "LLMOPT_FAILPOINT_ONCE"
TIMES_ENV = "LLMOPT_FAILPOINT_TIMES"
_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Act here when $LLMOPT_FAILPOINT names this point (see the module docstring for the actions)."""
    point, _, action = os.environ.get(ENV, "").partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if (times := os.environ.get(TIMES_ENV)) and _hits[name] > int(times):
        return
    if marker := os.environ.get(ONCE_ENV):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fail point {name})")
    if action == "oserror":
        raise OSError(f"fail point {name}: injected transient I/O error (hit {_hits[name]})")
    os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)

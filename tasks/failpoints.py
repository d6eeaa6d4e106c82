"""Fail points: named places where a test makes llmopt die as abruptly as a power cut or the OOM killer would.

`LLMOPT_FAILPOINT=<name>` makes the process SIGKILL itself when it reaches `failpoint(<name>)`; unset (always, in
normal use) it costs one environment lookup. The fault-matrix tests use them to kill a run at a known point of a
known stage (mid-write, mid-evaluation, …) instead of racing a timer against a stage that lasts milliseconds.
"""

from __future__ import annotations

import os
import signal

ENV = "LLMOPT_FAILPOINT"
ONCE_ENV = (
    "LLMOPT_FAILPOINT_ONCE"  # a file path: only the first process to reach the point dies (it creates it)
)


def failpoint(name: str) -> None:
    """SIGKILL this process here when $LLMOPT_FAILPOINT names this point (only the first process to get here when
    $LLMOPT_FAILPOINT_ONCE names a marker file: a task retried on another worker then goes through)."""
    if os.environ.get(ENV) != name:
        return
    if marker := os.environ.get(ONCE_ENV):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)

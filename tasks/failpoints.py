"""Fail points: named places where a test makes llmopt die as abruptly as a power cut or the OOM killer would.

`LLMOPT_FAILPOINT=<name>` makes the process SIGKILL itself when it reaches `failpoint(<name>)`; unset (always, in
normal use) it costs one environment lookup. The fault-matrix tests use them to kill a run at a known point of a
known stage (mid-write, mid-evaluation, …) instead of racing a timer against a stage that lasts milliseconds.
"""

from __future__ import annotations

import os
import signal

ENV = "LLMOPT_FAILPOINT"


def failpoint(name: str) -> None:
    """SIGKILL this process here when $LLMOPT_FAILPOINT names this point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)

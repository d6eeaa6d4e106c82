"""One real Prefect server for the session, started on first use: a module that opts in (`shared_prefect`) has its
llmopt commands report to it, so each does not start an ephemeral server of its own (~10 s here, ~27 s where the
project's database is new). The tests of the default path keep the ephemeral server (`ephemeral_prefect=True`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.project import SHARED_PREFECT_API

STARTUP_TIMEOUT_S = 300  # a new database is migrated first (~20 s on 2 shared cores)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`prefect server start` (no UI, no scheduler: nothing here is scheduled on it) in a folder of its own."""
    home = tmp_path_factory.mktemp("prefect-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    command = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    command += ["--no-scheduler", "--no-late-runs", "--analytics-off"]
    log = home / "server.log"
    server = subprocess.Popen(command, cwd=home, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            assert server.poll() is None, (
                f"the Prefect server exited ({server.returncode}):\n{log.read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"no Prefect server after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
            )
            time.sleep(0.2)  # polling its health endpoint, bounded by the deadline
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


@pytest.fixture(scope="module")
def shared_prefect(prefect_server: str) -> Iterator[str]:
    """The module's llmopt commands (tests/integration/project.py's `project_env`) report to the session's server."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SHARED_PREFECT_API, prefect_server)
        yield prefect_server

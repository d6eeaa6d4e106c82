"""One real Prefect server for the session, started on first use: a module that opts in (`shared_prefect`) has its
llmopt commands report to it, so each does not start an ephemeral server of its own (~10 s here, ~27 s where the
project's database is new). The tests of the default path keep the ephemeral server (`ephemeral_prefect=True`)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.integration.project import SHARED_PREFECT_API

STARTUP_TIMEOUT_S = 300  # a new database is migrated first (~20 s on 2 shared cores)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Prefect server of `llmopt services up` (infra/prefect-server.sh, started and stopped the way that
    command does), in a folder of its own, on a free port."""
    from flows.services import INFRA, Service, start, stop

    folder = tmp_path_factory.mktemp("prefect-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_HOME": str(folder / "prefect"), "PREFECT_PORT": str(port)}
    server = Service("prefect-server", INFRA / "prefect-server.sh", f"{api}/health", env, folder)
    start(server, timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield api
    finally:
        stop(server)


@pytest.fixture(scope="module")
def shared_prefect(prefect_server: str) -> Iterator[str]:
    """The module's llmopt commands (tests/integration/project.py's `project_env`) report to the session's server."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SHARED_PREFECT_API, prefect_server)
        yield prefect_server

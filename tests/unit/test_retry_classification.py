"""Which failures of registry and artifact I/O are retried: `transient_failure`, the retry condition of the
`register` and `fetch-production` tasks, given the Failed state Prefect hands it."""

from __future__ import annotations

import errno

import httpx
import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos import databricks_pb2
from prefect.states import Completed, Failed
from sqlalchemy.exc import OperationalError

from flows.retries import transient_failure
from tasks.errors import ArtifactError, ConfigError, LlmoptError, RegistryError

TRANSIENT = {
    "oserror": OSError("injected transient I/O error"),
    "connection_reset": ConnectionResetError(errno.ECONNRESET, "connection reset by peer"),
    "disk_full": OSError(errno.ENOSPC, "no space left on device"),
    "timeout": TimeoutError("timed out"),
    "sqlite_locked": OperationalError("insert ...", {}, Exception("database is locked")),
    "http_connect": httpx.ConnectError("connection refused"),
    "http_read_timeout": httpx.ReadTimeout("read timed out"),
    "mlflow_internal": MlflowException("API request failed", databricks_pb2.INTERNAL_ERROR),
    "mlflow_unavailable": MlflowException("database is locked", databricks_pb2.TEMPORARILY_UNAVAILABLE),
    "mlflow_rate_limited": MlflowException("slow down", databricks_pb2.REQUEST_LIMIT_EXCEEDED),
}
PERMANENT = {
    "llmopt_error": LlmoptError("something the user must fix"),
    "registry_error": RegistryError("no version 7 of tiny in the registry"),
    "corrupted_variant": ArtifactError("variant baseline: weights hash to 1234, refusing to use it"),
    "config_error": ConfigError("params.yaml: project.name: empty"),
    "mlflow_not_found": MlflowException("no such model", databricks_pb2.RESOURCE_DOES_NOT_EXIST),
    "mlflow_already_exists": MlflowException("exists", databricks_pb2.RESOURCE_ALREADY_EXISTS),
    "mlflow_bad_parameter": MlflowException("bad name", databricks_pb2.INVALID_PARAMETER_VALUE),
    "missing_file": FileNotFoundError(errno.ENOENT, "No such file or directory"),
    "permission_denied": PermissionError(errno.EACCES, "Permission denied"),
    "not_a_directory": NotADirectoryError(errno.ENOTDIR, "Not a directory"),
    "bug_value_error": ValueError("a bug"),
    "bug_key_error": KeyError("flavors"),
    "bug_type_error": TypeError("unsupported operand"),
}


@pytest.mark.parametrize("error", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_a_network_database_or_disk_hiccup_is_retried(error):
    assert transient_failure(None, None, Failed(data=error)) is True


@pytest.mark.parametrize("error", PERMANENT.values(), ids=PERMANENT.keys())
def test_a_user_error_a_refused_request_or_a_bug_is_not_retried(error):
    assert transient_failure(None, None, Failed(data=error)) is False


def test_a_completed_attempt_is_not_retried():
    assert transient_failure(None, None, Completed(data="done")) is False


@pytest.fixture
def registry_at(monkeypatch):
    """Point MLflow (tracking and registry) at a URI for one test; MLflow's own HTTP retries off."""
    import mlflow

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()

    def point(uri: str) -> None:
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)

    yield point
    point(previous[0])
    mlflow.set_registry_uri(previous[1])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_registry_that_does_not_answer_is_retried_not_reported_as_a_missing_version(registry_at, tmp_path):
    from tasks.decide.model_registry import download_version, version_tags

    registry_at(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for fetch in (lambda: version_tags("tiny", "1"), lambda: download_version("tiny", "1", tmp_path)):
        with pytest.raises(MlflowException) as raised:
            fetch()
        assert not isinstance(raised.value, LlmoptError)
        assert transient_failure(None, None, Failed(data=raised.value)) is True


def test_a_version_the_registry_does_not_hold_is_a_user_error(registry_at, tmp_path):
    from mlflow import MlflowClient

    from tasks.decide.model_registry import download_version, version_tags

    registry_at(f"sqlite:///{tmp_path / 'mlflow.db'}")
    MlflowClient().create_registered_model("tiny")
    for fetch in (lambda: version_tags("tiny", "7"), lambda: download_version("tiny", "7", tmp_path)):
        with pytest.raises(RegistryError) as raised:
            fetch()
        assert transient_failure(None, None, Failed(data=raised.value)) is False

"""The retry policy of registry and artifact I/O tasks: a network, database or disk hiccup is retried with
backoff; a user error, a request MLflow refuses, a wrong path or permission, or a bug is not."""

from __future__ import annotations

from prefect.tasks import exponential_backoff

from tasks.decide.model_registry import mlflow_retryable
from tasks.errors import LlmoptError


def transient_failure(task, task_run, state) -> bool:
    """Retry condition for registry and artifact I/O: a network, database or disk hiccup is retried (with
    backoff); a clear user error (LlmoptError: no such version, corrupted bytes), a request MLflow refuses (4xx:
    not found, already exists, bad parameter), a missing file or a denied permission, or a bug is not."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether the same call may well succeed when tried again a few seconds later."""
    import httpx
    from sqlalchemy.exc import OperationalError

    if isinstance(exc, (LlmoptError, *PERMANENT_OS_ERRORS)):
        return False
    retryable = mlflow_retryable(exc)
    if retryable is not None:
        return retryable
    return isinstance(exc, OSError | OperationalError | httpx.TransportError)


# OSErrors that no retry clears: the path or the permission is wrong, not the disk or the network
PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


IO_RETRIES = {  # 3 more tries, 2 s, 4 s, 8 s apart
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=2),
    "retry_condition_fn": transient_failure,
}

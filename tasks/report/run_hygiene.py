"""Run hygiene: which process owns an MLflow run, runs whose process died marked KILLED, and a tracking server
that stopped answering told apart from other failures (so the CLI can say so in one line)."""

from __future__ import annotations

from urllib.parse import urlparse

from tasks.errors import exception_chain


def tracking_unreachable(exc: BaseException) -> str | None:
    """The one-line story of an MLflow call that failed because the tracking server stopped answering, or None
    for any other failure (only for a tracking server, and only when the error names its address)."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or parsed.hostname is None:
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    for error in exception_chain(exc):
        text = str(error)
        about_the_server = f"{parsed.hostname}:{port}" in text or f"port={port}" in text
        if about_the_server and any(sign in text for sign in ("Max retries exceeded", "Connection refused")):
            return (
                f"tracking.uri: {uri} stopped answering, and the run stopped there (start the tracking server "
                "and run again: the next run marks this one KILLED; `llmopt history` shows whether production moved)"
            )
    return None


def process_tags() -> dict[str, str]:
    """Where a run runs: the host and the process (id and start time, so a reused pid is not mistaken for it)."""
    import socket

    import psutil

    me = psutil.Process()
    return {
        "llmopt.host": socket.gethostname(),
        "llmopt.pid": str(me.pid),
        "llmopt.pid_started": str(me.create_time()),
    }


def mark_ghost_runs(experiment_id: str) -> list[str]:
    """Runs left RUNNING by a process of this host that is gone (killed, SIGKILL included) become KILLED."""
    import socket

    import psutil
    from mlflow import MlflowClient

    client, host, ghosts = MlflowClient(), socket.gethostname(), []
    running = client.search_runs(
        [experiment_id], f"attributes.status = 'RUNNING' and tags.`llmopt.host` = '{host}'", max_results=1000
    )
    for run in running:
        pid, started = int(run.data.tags.get("llmopt.pid", "0")), run.data.tags.get("llmopt.pid_started")
        try:
            alive = str(psutil.Process(pid).create_time()) == started
        except (psutil.NoSuchProcess, ValueError):
            alive = False
        if not alive:
            client.set_terminated(run.info.run_id, "KILLED")
            ghosts.append(run.info.run_id)
    return ghosts

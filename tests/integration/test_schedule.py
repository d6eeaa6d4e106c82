"""Scheduled operation on a real Prefect server that llmopt starts itself: a deployment with a few-second interval
runs the pipeline on the tiny model and registers a version; `--once` triggers a run through a deployment and
prints its result; everything started is stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.project import make_project, project_env, run, tiny_params

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def project(tmp_path, tiny_model_dir, corpus_dir):
    params = tiny_params(
        tiny_model_dir,
        corpus_dir,
        project={"name": "scheduled"},
        services={"prefect_port": free_port()},
        schedule={"cron": None, "interval_s": 5, "deployment": "every-5s"},
    )
    root = make_project(tmp_path / "project", params, with_dvc=False)
    by_hand = {**params, "schedule": {"deployment": "by-hand"}}  # nightly cron: only --once runs it
    (root / "once.yaml").write_text(yaml.safe_dump(by_hand, sort_keys=False))
    yield root, params["services"]["prefect_port"]
    run(root, "llmopt", "services", "down", check=False)


def completed_ticks(port: int, deployment: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = {PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}  # this server, not a temporary one
    with temporary_settings(api), get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(f"llmopt-scheduled/{deployment}")
        except ObjectNotFound:
            return []
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[found.id]))
        )
    return [r for r in runs if r.auto_scheduled and r.state and r.state.is_completed()]


def test_a_scheduled_run_registers_a_version_and_once_reports_through_the_deployment(project):
    root, port = project
    env = {**project_env(root), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    up = run(root, "llmopt", "services", "up")
    assert f"prefect-server: started, http://127.0.0.1:{port}/api/health" in up.stderr
    log_file = root / "schedule.log"
    scheduler = subprocess.Popen(
        ["llmopt", "schedule"],
        cwd=root,
        env=env,
        stdout=log_file.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not completed_ticks(port, "every-5s"):
            assert scheduler.poll() is None, log_file.read_text()
            assert time.monotonic() < deadline, log_file.read_text()[-3000:]
            time.sleep(1)  # the Prefect server has no push notification for a finished run
    finally:
        os.killpg(scheduler.pid, signal.SIGTERM)
        scheduler.wait(timeout=60)
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    production = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_by_alias(
        "scheduled", "production"
    )
    assert (
        production.tags["llmopt.variant"] == "onnx_int8"
    )  # the scheduled run registered the fastest variant

    once = subprocess.run(
        ["llmopt", "schedule", "--once", "-p", "once.yaml"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert once.returncode == 0, once.stderr[-3000:]
    assert (
        once.stderr.strip()
        .splitlines()[-1]
        .startswith(f"production unchanged: production v{production.version}")
    )

    pid = int((root / ".llmopt/services/prefect-server.pid").read_text().split()[0])  # pid, start time
    assert "prefect-server: stopped" in run(root, "llmopt", "services", "down").stderr
    assert "prefect-server: down" in run(root, "llmopt", "services", "status").stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # gone
    assert not Path(root / ".llmopt/services/prefect-server.pid").exists()

"""Scheduled operation on a real Prefect server that llmopt starts itself: a deployment with a few-second interval
runs the pipeline on the tiny model and registers a version; `--once` triggers a run through a deployment and
prints its result; one run at a time (a tick during a run is cancelled, the next runs); a run past
schedule.timeout_min fails; everything started is stopped. Runs that must last are held at the `scheduled-run`
fail point (SIGSTOP), not made slow."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import time
from datetime import UTC, datetime
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


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, corpus_dir):
    """A project of the baseline alone (a short pipeline run) and its Prefect server, shared by the tests below;
    each serves a deployment of its own on it."""
    port = free_port()
    params = tiny_params(
        tiny_model_dir,
        corpus_dir,
        project={"name": "one-at-a-time"},
        services={"prefect_port": port},
        schedule={"cron": None, "interval_s": 5, "deployment": "every-5s"},
    )
    params["variants"] = {"baseline": {}}
    # the shortest measurement the config allows: these tests are about runs, not about what a run measures
    params["benchmark"] = {**params["benchmark"], "batch_sizes": [1], "ttft_prompt_tokens": [8]}
    params["benchmark"] |= {"requests": 1, "warmup": 0, "repeats": 1}
    root = make_project(tmp_path_factory.mktemp("scheduled") / "project", params, with_dvc=False)
    timeout = {
        **params,
        "schedule": {"deployment": "short-timeout", "timeout_min": 0.05},
    }  # 3 s; by hand only
    (root / "timeout.yaml").write_text(yaml.safe_dump(timeout, sort_keys=False))
    run(root, "llmopt", "services", "up")
    yield root, port
    run(root, "llmopt", "services", "down", check=False)


@contextlib.contextmanager
def prefect_client(port: int):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}),
        get_client(sync_client=True) as client,
    ):
        yield client


def deployment_runs(client, deployment: str) -> list:
    """Every flow run of the deployment (none before it is registered), oldest scheduled first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.exceptions import ObjectNotFound

    try:
        found = client.read_deployment_by_name(f"llmopt-scheduled/{deployment}")
    except ObjectNotFound:
        return []
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[found.id])), limit=200
    )
    return sorted(runs, key=lambda r: r.expected_start_time)


def stopped_descendants(pid: int) -> list[psutil.Process]:
    """The processes under `pid` that a fail point stopped (SIGSTOP)."""
    stopped = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() == psutil.STATUS_STOPPED:
                stopped.append(child)
    return stopped


def wait_for(condition, what: str, process: subprocess.Popen, log: Path, timeout_s: float = 180):
    """Poll `condition` until it returns something truthy (returned); fail when `process` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert process.poll() is None, (
            f"exited ({process.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)  # the Prefect server has no push notification for state changes
    return found


def start_llmopt(root: Path, args: list[str], log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["llmopt", *args],
        cwd=root,
        env={**project_env(root), "PREFECT_RUNNER_POLL_FREQUENCY": "1", **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def end_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the group, and SIGCONT: a stopped process acts on SIGTERM only once it runs again."""
    if process.poll() is None:
        for signum in (signal.SIGTERM, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)
        process.wait(timeout=60)


def test_a_tick_during_a_run_is_cancelled_and_the_next_tick_runs(server):
    root, port = server
    log = root / "one-at-a-time.log"
    held = {"LLMOPT_FAILPOINT": "scheduled-run:stop", "LLMOPT_FAILPOINT_ONCE": str(root / "held-once")}
    scheduler = start_llmopt(root, ["schedule"], log, **held)  # only its first run stops at the fail point
    try:
        with prefect_client(port) as client:
            stopped = wait_for(lambda: stopped_descendants(scheduler.pid), "run held", scheduler, log)
            first = next(r for r in deployment_runs(client, "every-5s") if r.state.is_running())

            def cancelled_tick():  # one whose time came while the first run was going
                runs = deployment_runs(client, "every-5s")
                came = [r for r in runs if first.start_time < r.expected_start_time < datetime.now(UTC)]
                return next((r for r in came if r.state.is_cancelled()), None)

            collided = wait_for(cancelled_tick, "cancelled tick", scheduler, log)
            assert collided.state.name == "Cancelled"
            assert collided.state.message == "Deployment concurrency limit reached."
            assert collided.auto_scheduled and collided.run_count == 0  # it never ran
            assert first.id in {r.id for r in deployment_runs(client, "every-5s") if r.state.is_running()}

            for process in stopped:  # the held run ends (as a run killed by the OOM killer would)
                process.kill()
            first = wait_for(
                lambda: (r := client.read_flow_run(first.id)).state.is_final() and r,
                "first run end",
                scheduler,
                log,
            )
            assert first.state.name == "Crashed", first.state

            def later_completed_tick():
                runs = deployment_runs(client, "every-5s")
                after = [r for r in runs if r.expected_start_time > first.end_time]
                return next((r for r in after if r.state.is_completed()), None)

            later = wait_for(later_completed_tick, "later completed tick", scheduler, log)
            runs = deployment_runs(client, "every-5s")
    finally:
        end_process_group(scheduler)
    due = [r for r in runs if r.id != first.id and r.expected_start_time <= first.end_time]
    assert all(r.state.name == "Cancelled" for r in due), [
        (r.name, r.state.name) for r in due
    ]  # none ran late
    spans = sorted((r.start_time, r.end_time or datetime.now(UTC)) for r in runs if r.run_count)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans  # never two runs at once
    assert later.auto_scheduled and later.state.name == "Completed"


def test_a_run_longer_than_schedule_timeout_min_is_failed(server):
    root, port = server
    log = root / "timeout.log"
    once = start_llmopt(
        root, ["schedule", "--once", "-p", "timeout.yaml"], log, LLMOPT_FAILPOINT="scheduled-run:stop"
    )
    try:
        stopped = wait_for(lambda: stopped_descendants(once.pid), "run held", once, log)
        with prefect_client(port) as client:
            held = next(r for r in deployment_runs(client, "short-timeout") if r.state.is_running())
            timeout_s = 0.05 * 60
            # its timeout expires while it is stopped; it acts on it when it runs again
            wait_for(
                lambda: (datetime.now(UTC) - held.start_time).total_seconds() > timeout_s + 1,
                "3 s",
                once,
                log,
            )
            for process in stopped:
                process.resume()
            assert once.wait(timeout=120) == 1, log.read_text()[-3000:]
            ended = client.read_flow_run(held.id)
    finally:
        end_process_group(once)
    assert ended.state.type.value == "FAILED" and ended.state.name == "TimedOut", ended.state
    assert ended.state.message == "Flow run exceeded timeout of 3.0 second(s)"
    last_line = log.read_text().strip().splitlines()[-1]
    assert last_line.endswith(f"run {ended.name} ended TimedOut: Flow run exceeded timeout of 3.0 second(s)")

"""The pipeline on a schedule: a Prefect deployment of `scheduled_pipeline`, served (`flow.serve`) against the
Prefect server of `llmopt services`. One run at a time across every runner of the deployment (a deployment
concurrency limit of 1): a tick that comes while a run is going is cancelled, and the next tick runs as usual. A
run longer than schedule.timeout_min is failed."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefect import flow

from tasks.errors import ConfigError, LlmoptError, ServiceError
from tasks.failpoints import failpoint
from tasks.params import Config
from tasks.params_file import load_config

FLOW_NAME = "llmopt-scheduled"
PICK_UP_S = 120  # a run on a work pool that no worker has started after this long is reported, not waited on


@flow(name=FLOW_NAME, persist_result=True)  # persisted: `--once` reads the last line from another process
def scheduled_pipeline(params_path: str) -> str:
    """One pipeline run with the settings in `params_path` as they are when the tick fires; returns its last
    line (what happened to production, and why)."""
    from flows.cluster import on_cluster
    from flows.pipeline import pipeline_flow

    failpoint("scheduled-run")  # tests: SIGSTOP, so a run lasts exactly as long as a test needs
    path = Path(params_path)
    config = load_config(path)
    return on_cluster(pipeline_flow, config)(config, path.resolve().parent).summary()


def deployment_name(config: Config) -> str:
    """`<flow>/<deployment>`, the name Prefect's UI, CLI and `run_deployment` know the deployment by."""
    return f"{FLOW_NAME}/{config.schedule.deployment}"


def check_schedule(config: Config) -> None:
    """A cron expression Prefect would refuse is a configuration error, said before anything starts."""
    from prefect.client.schemas.schedules import CronSchedule

    if config.schedule.cron is not None:
        try:
            CronSchedule(cron=config.schedule.cron)
        except ValueError as exc:
            raise ConfigError(
                f"schedule.cron: {config.schedule.cron!r} is not a valid cron expression"
            ) from exc


def serve_schedule(config: Config, params_path: Path, pause_on_shutdown: bool = True) -> None:
    """Register the deployment with its schedule and run its scheduled runs until interrupted (which pauses the
    schedule unless `pause_on_shutdown` is off: no runs pile up while nobody serves them)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig

    timed = scheduled_pipeline.with_options(timeout_seconds=config.schedule.timeout_min * 60)
    timed.serve(
        name=config.schedule.deployment,
        parameters={"params_path": str(params_path.resolve())},
        # one pipeline run at a time, whoever serves the deployment: runs on one machine would share its cores
        # and skew each other's benchmarks; a tick that collides with a running one is cancelled by the server.
        # No runner limit beside it: a runner at its limit leaves due ticks Scheduled, and runs them late, one
        # after another, once the run ends, instead of handing them to the server to cancel
        global_limit=ConcurrencyLimitConfig(limit=1, collision_strategy="CANCEL_NEW"),
        print_starting_message=False,
        pause_on_shutdown=pause_on_shutdown,
        description="llmopt pipeline on a schedule (params.yaml: schedule, services)",
        **config.schedule.when,
    )


def deploy_to_pool(config: Config, params_path: Path) -> str:
    """Create (or update) the deployment on schedule.work_pool, with its schedule; the pool's workers run it. The
    pool is created (process type) when it does not exist yet. Returns the deployment's id."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.objects import ConcurrencyLimitConfig
    from prefect.exceptions import ObjectAlreadyExists

    pool = str(config.schedule.work_pool)
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):  # made before
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    source = Path(__file__).resolve().parents[1]  # the project; a worker elsewhere needs it at the same path
    remote = scheduled_pipeline.from_source(
        source=str(source), entrypoint="flows/schedule.py:scheduled_pipeline"
    )
    with contextlib.redirect_stdout(io.StringIO()):  # Prefect's hints and table (our own line says it all)
        deployment_id = remote.deploy(
            name=config.schedule.deployment,
            work_pool_name=pool,
            parameters={"params_path": str(params_path.resolve())},
            concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy="CANCEL_NEW"),
            description="llmopt pipeline on a schedule (params.yaml: schedule, services, cluster)",
            print_next_steps=False,
            build=False,
            push=False,
            **config.schedule.when,
        )
    return str(deployment_id)


def run_on_pool(config: Config, params_path: Path) -> str:
    """Deploy to the work pool, trigger one run now and wait for a worker of the pool to run it; its last line."""
    deploy_to_pool(config, params_path)
    return _trigger_and_wait(config, params_path, None, None)


def run_once(config: Config, params_path: Path, runner_log: Path) -> str:
    """Trigger one run of the deployment now, with a runner serving it for that long, and wait for the run;
    its last line, or an LlmoptError saying how it ended."""
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "schedule",
        "-p",
        str(params_path),
        "--keep-schedule-on-exit",
    ]
    try:
        with runner_log.open("ab") as out:
            runner = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise ServiceError(f"cannot start a runner for {deployment_name(config)}: {exc}") from None
    try:
        return _trigger_and_wait(config, params_path, runner, runner_log)
    finally:
        _stop(runner)


def _trigger_and_wait(
    config: Config, params_path: Path, runner: subprocess.Popen | None, runner_log: Path | None
) -> str:
    """Trigger the deployment and wait for the run (`runner`: the process serving it, watched; None: the work
    pool's workers run it)."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    deadline = time.monotonic() + config.schedule.timeout_min * 60 + 120
    with get_client(sync_client=True) as client:
        _wait_for_deployment(client, config, runner, runner_log)
        parameters = {"params_path": str(params_path.resolve())}
        flow_run = run_deployment(name=deployment_name(config), parameters=parameters, timeout=0)
        started = time.monotonic()
        while not (state := client.read_flow_run(flow_run.id).state) or not state.is_final():
            waiting = time.monotonic() - started
            if runner is None and state is not None and state.is_scheduled() and waiting > PICK_UP_S:
                from prefect.states import Cancelled

                # cancelled, so that a worker starting later does not run it behind the user's back
                client.set_flow_run_state(
                    flow_run.id, Cancelled(message="no worker picked it up"), force=True
                )
                raise ServiceError(
                    f"run {flow_run.name} still {state.name} after {PICK_UP_S} s: no worker of work pool "
                    f"{config.schedule.work_pool!r} picked it up (services.prefect_worker starts one here, or run "
                    f"`prefect worker start --pool {config.schedule.work_pool}` where the pipeline should run)"
                )
            if runner is not None and runner.poll() is not None:
                raise ServiceError(
                    f"the runner exited ({runner.returncode}) before run {flow_run.name} ended; see {runner_log}"
                )
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"run {flow_run.name} still {state.name if state else 'pending'} at the timeout"
                )
            time.sleep(2)  # Prefect's server has no push notification for a run's end
    if not state.is_completed():
        raise LlmoptError(f"run {flow_run.name} ended {state.name}: {state.message}")
    try:
        return str(state.result(raise_on_failure=False))
    except Exception:  # persisted on the worker's machine, out of reach from here
        return f"run {flow_run.name} completed (its last line is in the worker's log and the Prefect UI)"


def _wait_for_deployment(client, config: Config, runner: subprocess.Popen, runner_log: Path) -> None:
    """Until the starting runner has registered the deployment (an existing one is updated by it, too)."""
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + 120
    while True:
        try:
            client.read_deployment_by_name(deployment_name(config))
            return
        except ObjectNotFound:
            if (runner is not None and runner.poll() is not None) or time.monotonic() > deadline:
                raise ServiceError(
                    f"{deployment_name(config)} was not registered; see {runner_log}"
                ) from None
            time.sleep(0.5)  # the server has no notification for a new deployment


def _stop(runner: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the runner's process group, SIGKILL if it is still there after `grace_s`."""
    if runner.poll() is None:
        os.killpg(runner.pid, signal.SIGTERM)
        try:
            runner.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()

"""The pipeline on a schedule: a Prefect deployment of `scheduled_pipeline`, served (`flow.serve`) against the
Prefect server of `llmopt services`. One run at a time: a tick that comes while a run is going waits (Prefect shows
it as Late); when the run ends, only the newest waiting tick runs the pipeline, older ones end at once as
superseded (a backlog of stale ticks would only measure the same thing again). A run longer than
schedule.timeout_min is failed."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from prefect import flow

from tasks.config import Config, load_config

FLOW_NAME = "llmopt-scheduled"


@flow(name=FLOW_NAME, log_prints=True)
def scheduled_pipeline(params_path: str) -> str:
    """One pipeline run with the settings in `params_path` as they are when the tick fires; returns its last
    line (what happened to production, and why)."""
    from flows.pipeline import pipeline_flow

    newer = _newer_waiting_tick()
    if newer is not None:
        return f"skipped: superseded by the later tick {newer} (one pipeline run at a time)"
    path = Path(params_path)
    outcome = pipeline_flow(load_config(path), path.resolve().parent)
    return outcome.summary()


def superseded_by(
    scheduled: datetime | None, waiting: list[tuple[str, datetime]], now: datetime
) -> str | None:
    """The newest other run already due that was scheduled after this one, if any (then this one is stale)."""
    if scheduled is None:
        return None  # triggered by hand (`--once`): always runs
    due = [(when, name) for name, when in waiting if scheduled < when <= now]
    return max(due)[1] if due else None


def _newer_waiting_tick() -> str | None:
    """Ask the server for runs of this deployment waiting their turn (SCHEDULED, Late included)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        me = client.read_flow_run(flow_run.id)
        if me.deployment_id is None or not me.auto_scheduled:
            return None  # not a tick: run by hand or outside a deployment
        waiting = FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[me.deployment_id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
        )
        runs = client.read_flow_runs(flow_run_filter=waiting)
    ticks = [
        (run.name, run.expected_start_time) for run in runs if run.auto_scheduled and run.expected_start_time
    ]
    return superseded_by(me.expected_start_time, ticks, datetime.now(UTC))


def deployment_name(config: Config) -> str:
    return f"{FLOW_NAME}/{config.schedule.deployment}"


def serve_schedule(config: Config, params_path: Path, pause_on_shutdown: bool = True) -> None:
    """Register the deployment with its schedule and run its scheduled runs until interrupted (which pauses the
    schedule unless `pause_on_shutdown` is off: no runs pile up while nobody serves them)."""
    timed = scheduled_pipeline.with_options(timeout_seconds=config.schedule.timeout_min * 60)
    timed.serve(
        name=config.schedule.deployment,
        parameters={"params_path": str(params_path.resolve())},
        limit=1,  # one pipeline run at a time on this machine: they would share its cores and skew benchmarks
        print_starting_message=False,
        pause_on_shutdown=pause_on_shutdown,
        description="llmopt pipeline on a schedule (params.yaml: schedule, services)",
        **config.schedule.when,
    )


def run_once(config: Config, timeout_s: float) -> tuple[bool, str]:
    """Trigger one run of the deployment now and wait for it: (completed, its last line or why it failed)."""
    from prefect.deployments import run_deployment

    wait_for_deployment(config, timeout_s=120)
    flow_run = run_deployment(name=deployment_name(config), timeout=timeout_s, poll_interval=2)
    state = flow_run.state
    if state is None or not state.is_final():
        return (
            False,
            f"run {flow_run.name} still {state.name if state else 'pending'} after {timeout_s:.0f} s",
        )
    if state.is_completed():
        return True, str(state.result(raise_on_failure=False))
    return False, f"run {flow_run.name} {state.name}: {state.message}"


def wait_for_deployment(config: Config, timeout_s: float) -> None:
    """Block until the deployment is registered on the server (a starting `llmopt schedule` registers it)."""
    import time

    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from tasks.errors import ServiceError

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(deployment_name(config))
                return
            except ObjectNotFound:
                if time.monotonic() > deadline:
                    message = f"deployment {deployment_name(config)} not registered after {timeout_s:.0f} s"
                    raise ServiceError(message) from None
                time.sleep(0.5)  # the server has no notification for a new deployment

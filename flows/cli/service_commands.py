"""Commands for the services llmopt starts itself (`llmopt services up|down|status`) and the schedule."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.app import DebugOption, ParamsOption, app
from flows.cli.session import CommandSession, console, each_service
from tasks.params_file import load_config

services_app = typer.Typer(
    help="Services llmopt starts itself (scripts under infra/): the Prefect server that `llmopt schedule` needs.",
    no_args_is_help=True,
)
app.add_typer(services_app, name="services")


@services_app.command("up")
def services_up(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Start the configured services in the background (no-op for those already up) and wait until they answer."""
    with CommandSession(debug) as session:
        from flows.services import start_all

        each_service(load_config(params, session.notice), params, start_all)


@services_app.command("down")
def services_down(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Stop the services llmopt started (their data stays under project.workdir/services)."""
    with CommandSession(debug) as session:
        from flows.services import stop_all

        each_service(load_config(params, session.notice), params, stop_all)


@services_app.command("status")
def services_status(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Whether each configured service is up and answering."""
    with CommandSession(debug) as session:
        from flows.services import status_all

        each_service(load_config(params, session.notice), params, status_all)


@app.command()
def schedule(
    params: ParamsOption = Path("params.yaml"),
    once: Annotated[
        bool,
        typer.Option("--once", help="Trigger one run through the deployment now, wait, print its result."),
    ] = False,
    keep_schedule_on_exit: Annotated[
        bool, typer.Option(hidden=True, help="Used by --once: stopping does not pause the deployment.")
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Run the pipeline on params.yaml's schedule (cron or interval): a Prefect deployment served against the
    Prefect server, which is started first if it is not up. Runs until interrupted (Ctrl-C pauses the schedule);
    one pipeline run at a time. The Prefect UI (services.prefect_port) shows the runs. With schedule.work_pool the
    deployment goes to that work pool instead and this returns at once: the pool's workers run it."""
    with CommandSession(debug) as session:
        config, root = session.scheduled(params)
        from flows.schedule import deploy_to_pool, deployment_name, run_on_pool, run_once, serve_schedule

        pool = config.schedule.work_pool
        if pool and once:
            console.print(
                f"Triggering {deployment_name(config)} on work pool {pool}", soft_wrap=True, highlight=False
            )
            console.print(run_on_pool(config, params), soft_wrap=True, highlight=False)
            return
        if pool:
            deploy_to_pool(config, params)
            when = ", ".join(f"{key} {value}" for key, value in config.schedule.when.items())
            console.print(
                f"Deployed {deployment_name(config)} ({when}) on work pool {pool}: its workers run it "
                f"(services.prefect_worker, or `prefect worker start --pool {pool}`). Prefect UI "
                f"http://127.0.0.1:{config.services.prefect_port}.",
                soft_wrap=True,
                highlight=False,
            )
            return
        if once:
            log = Path(os.environ["PREFECT_HOME"]) / "schedule-once.log"
            console.print(
                f"Triggering {deployment_name(config)} (runner log {log})", soft_wrap=True, highlight=False
            )
            console.print(run_once(config, params, log), soft_wrap=True, highlight=False)
            return
        when = ", ".join(f"{key} {value}" for key, value in config.schedule.when.items())
        console.print(
            f"Serving {deployment_name(config)} ({when}); Prefect UI http://127.0.0.1:{config.services.prefect_port}."
            " Ctrl-C stops.",
            soft_wrap=True,
            highlight=False,
        )
        serve_schedule(config, params, pause_on_shutdown=not keep_schedule_on_exit)

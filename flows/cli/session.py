"""One command's session: the configuration, the environment set before Prefect is first imported, the pre-flight
checks, the full log file, and user errors turned into one red line and an exit code."""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

import typer
from rich.console import Console

from tasks.errors import LlmoptError, RegistryError
from tasks.params import Config
from tasks.params_file import load_config

console = Console(stderr=True)
# Commands that write the project's shared state: each holds the project lock (tasks/project_lock.py) until it ends
WRITERS = frozenset({"run", "promote", "bench", "prepare", "rollback", "search"})


class CommandSession:
    """`with CommandSession(debug) as session:` around a command's body. An LlmoptError becomes one red line and
    its exit code (--debug keeps the traceback); once the pre-flight checks passed, the log file is named too."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug
        self.log_file: Path | None = None  # this command's full log, once the pre-flight checks passed
        self._noticed: set[str] = set()  # deprecation lines already printed (a command may read params twice)
        self._locks = contextlib.ExitStack()

    def __enter__(self) -> CommandSession:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self._locks.close()
        if (
            exc is not None
            and not isinstance(exc, LlmoptError)
            and not self.debug
            and self.log_file is not None
        ):
            from tasks.report.tracking import tracking_unreachable

            story = tracking_unreachable(exc)  # a registry that vanished mid-run is the user's to restart
            if story:
                with self.log_file.open("a") as log:  # the full story stays in the log
                    log.write("".join(traceback.format_exception(exc)))
                exc = RegistryError(story)
        if isinstance(exc, LlmoptError) and not self.debug:
            if self.log_file is not None:
                console.print(
                    f"[dim]full log: {self.log_file} (--debug shows it all here)[/]",
                    highlight=False,
                    soft_wrap=True,
                )
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code)
        return False

    def notice(self, line: str) -> None:
        """A deprecation line, printed once per command."""
        if line not in self._noticed:
            self._noticed.add(line)
            console.print(f"[yellow]deprecated:[/] {line}", highlight=False, soft_wrap=True)

    def setup(self, params: Path) -> tuple[Config, Path]:
        """The validated config and the project root, with the embedded environment defaults set."""
        self.log_file = None  # set again once this command's pre-flight checks pass
        config = load_config(params, self.notice)
        root = params.resolve().parent
        _configure_environment(root / config.project.workdir, self.debug)
        return config, root

    def lock(self, config: Config, root: Path, command: str) -> None:
        """Hold the project lock until the command ends (waiting, with a line saying for whom, while another
        process holds it)."""
        from tasks.project_lock import project_lock

        def say(line: str) -> None:
            console.print(f"[yellow]{line}[/]", highlight=False, soft_wrap=True)

        self._locks.enter_context(project_lock(root / config.project.workdir, f"llmopt {command}", say))

    def flow_run(
        self,
        params: Path,
        command: str,
        extra_checks=(),
        starts_services: bool = False,
        imports: tuple[str, ...] = (),
    ) -> tuple[Config, Path]:
        """Config, the pre-flight checks (all of them, before Prefect starts), Prefect's home folder, (unless
        --debug) the console filtered, everything kept in `.llmopt/logs/<command>-<time>.log`, and Prefect's
        temporary server started while the command's heavy modules (`imports`) load."""
        config, root = self.setup(params)
        from tasks.preflight import preflight

        preflight(config, root, extra_checks, starts_services)
        if command in WRITERS:
            self.lock(config, root, command)
        # Prefect's embedded server needs its home folder to exist before it opens its database there.
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
        if not self.debug:
            from flows.logs import route_logs

            self.log_file = route_logs(root / config.project.workdir, command)
        _start_prefect_while_importing(imports)
        return config, root

    def scheduled(self, params: Path) -> tuple[Config, Path]:
        """Prefect pointed at the Prefect server (before Prefect is first imported: it reads its settings once),
        the pre-flight checks (the schedule's too), then the services up."""
        from flows.services import prefect_api_url, start_all

        os.environ["PREFECT_API_URL"] = prefect_api_url(load_config(params, notice=lambda _line: None))
        os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "5")  # seconds between looks for due runs
        config, root = self.flow_run(params, "schedule", (_check_schedule,), starts_services=True)
        each_service(config, params, start_all)
        return config, root


def _start_prefect_while_importing(modules: tuple[str, ...]) -> None:
    """With no Prefect server configured, the flow runs on Prefect's temporary one, whose process takes ~9 s to
    answer on 2 cores (~27 s in a new project: its database is migrated first) while this one would wait. Start it
    now from a thread that only waits for it, import `modules` meanwhile, then wait: the flow's client finds that
    same server (one per process) answering. A server that fails to start fails again, with Prefect's own error,
    when the flow asks for it."""
    from prefect.settings import PREFECT_API_URL

    if not modules or PREFECT_API_URL.value():
        return
    import importlib
    import threading

    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's client starts when it needs the API

    def start() -> None:
        with contextlib.suppress(Exception):
            server.start()

    starting = threading.Thread(target=start, name="prefect-server", daemon=True)
    starting.start()
    for module in modules:
        importlib.import_module(module)
    starting.join()


def each_service(config: Config, params: Path, action) -> None:
    """Apply `action` (start_all, stop_all, status_all) to the configured services, printing each one's line."""
    from flows.services import configured_services

    action(
        configured_services(config, params.resolve().parent),
        lambda line: console.print(line, soft_wrap=True, highlight=False),
    )


def _check_schedule(config: Config) -> None:
    from flows.schedule import (
        check_schedule,
    )  # imports Prefect: only once its settings are in the environment

    check_schedule(config)


def _configure_environment(workdir: Path, debug: bool) -> None:
    """Embedded defaults (Prefect home inside the project, offline hub) before Prefect is first imported."""
    os.environ.setdefault("PREFECT_HOME", str(workdir / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # a cuda target's compiled decode steps: inductor's kernels kept with the project, so the next process (a
    # benchmark's, the server's) and the next run find them instead of compiling again
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(workdir / "inductor"))
    if not debug:
        from tasks.quiet import quiet_libraries

        quiet_libraries()
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

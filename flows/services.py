"""Long-running services llmopt starts and stops itself (`llmopt services up|down|status`): each is a script
under infra/ run in the background, with its log and pid file under project.workdir/services: the Prefect server
that `llmopt schedule` serves its deployment against and, with services.tracking_stack, PostgreSQL, an S3
endpoint and the MLflow tracking server on both."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tasks.errors import ServiceError
from tasks.params import Config

INFRA = Path(__file__).resolve().parents[1] / "infra"


@dataclass(frozen=True)
class Service:
    name: str
    script: Path
    health_url: str  # answers 200 when the service is ready
    env: dict[str, str]  # added to the environment of the script
    folder: Path  # log, pid file and data
    after: tuple[str, ...] = ()  # the services that must answer before this one starts (and stop after it)

    @property
    def pid_file(self) -> Path:
        return self.folder / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.folder / f"{self.name}.log"


def prefect_api_url(config: Config) -> str:
    """Where the Prefect server of `llmopt services` answers (what PREFECT_API_URL is set to)."""
    return f"http://127.0.0.1:{config.services.prefect_port}/api"


def postgres_data(config: Config, root: Path) -> Path:
    """The tracking stack's PostgreSQL data folder (services.postgres_data, default project.workdir/services)."""
    configured = config.services.postgres_data
    return Path(configured) if configured else root / config.project.workdir / "services" / "postgres"


def postgres_password_file(config: Config, root: Path) -> Path:
    """Where infra/postgres.sh keeps the generated superuser password of the tracking stack (mode 600)."""
    data = postgres_data(config, root)
    return data.with_name(data.name + ".password")


def configured_services(config: Config, root: Path) -> list[Service]:
    """The services this configuration needs, in start order."""
    folder = root / config.project.workdir / "services"
    env = {"PREFECT_HOME": str(folder / "prefect"), "PREFECT_PORT": str(config.services.prefect_port)}
    if config.services.prefect_database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = config.services.prefect_database_url
    api = prefect_api_url(config)
    # a configured Prefect database may be the stack's PostgreSQL
    database = (
        ("postgres",) if config.services.prefect_database_url and config.services.tracking_stack else ()
    )
    services = [
        Service("prefect-server", INFRA / "prefect-server.sh", f"{api}/health", env, folder, database)
    ]
    services += _workers(config, folder)
    if not config.services.tracking_stack:
        return services
    cfg = config.services
    stack_env = {
        "PGPORT": str(cfg.postgres_port),
        "S3_PORT": str(cfg.s3_port),
        "MLFLOW_PORT": str(cfg.mlflow_port),
        "PGDATA": str(postgres_data(config, root)),
        "PGPASSWORD_FILE": str(postgres_password_file(config, root)),
    }
    return [
        Service("postgres", INFRA / "postgres.sh", f"tcp://127.0.0.1:{cfg.postgres_port}", stack_env, folder),
        Service("s3", INFRA / "s3.sh", f"http://127.0.0.1:{cfg.s3_port}/moto-api/", stack_env, folder),
        Service(
            "mlflow-server",
            INFRA / "mlflow-server.sh",
            f"http://127.0.0.1:{cfg.mlflow_port}/health",
            stack_env,
            folder,
            ("postgres", "s3"),
        ),
        *services,
    ]


def _workers(config: Config, folder: Path) -> list[Service]:
    """The Prefect worker (services.prefect_worker) and the Dask cluster (services.dask_workers): the scheduler, and
    workers of which the first offers the `benchmark` resource (one benchmark at a time on this machine)."""
    cfg, services = config.services, []
    if cfg.prefect_worker:
        port = cfg.prefect_port + 1
        env = {
            "PREFECT_API_URL": prefect_api_url(config),
            "PREFECT_WORK_POOL": str(config.schedule.work_pool),
            "PREFECT_WORKER_WEBSERVER_PORT": str(port),
            "PREFECT_HOME": str(folder / "prefect-worker"),
        }
        services.append(
            Service(
                "prefect-worker",
                INFRA / "prefect-worker.sh",
                f"http://127.0.0.1:{port}/health",
                env,
                folder,
                ("prefect-server",),
            )
        )
    if cfg.dask_workers:
        env = {"DASK_PORT": str(cfg.dask_port), "DASK_HTTP_PORT": str(cfg.dask_port + 1)}
        health = f"http://127.0.0.1:{cfg.dask_port + 1}/health"
        services.append(Service("dask-scheduler", INFRA / "dask-scheduler.sh", health, env, folder))
    for index in range(cfg.dask_workers):
        port = cfg.dask_port + 2 + index
        env = {
            "DASK_SCHEDULER": f"tcp://127.0.0.1:{cfg.dask_port}",
            "DASK_WORKER_NAME": f"llmopt-{index}",
            "DASK_WORKER_HTTP_PORT": str(port),
            "DASK_RESOURCES": "benchmark=1" if index == 0 else "",
        }
        health = f"http://127.0.0.1:{port}/health"
        services.append(
            Service(
                f"dask-worker-{index}", INFRA / "dask-worker.sh", health, env, folder, ("dask-scheduler",)
            )
        )
    return services


def start_all(services: list[Service], report: Callable[[str], None]) -> None:
    """Start every service, each as soon as those it comes `after` answer: independent ones start together (each
    spends seconds importing its server, mostly on one core). `report` gets each one's line as it is done; a service
    whose dependency failed is not started; the failures are raised together at the end."""
    _in_dependency_order(services, start, lambda service: service.after, "not started", report)


def stop_all(services: list[Service], report: Callable[[str], None]) -> None:
    """Stop every service, each once those that come `after` it are stopped (a worker before its server)."""
    names = {service.name for service in services}
    dependents = {name: tuple(s.name for s in services if name in s.after) for name in names}
    _in_dependency_order(services, stop, lambda service: dependents[service.name], "", report)


def _in_dependency_order(
    services: list[Service],
    action: Callable[[Service], str],
    waits_for: Callable[[Service], tuple[str, ...]],
    skipped: str,
    report: Callable[[str], None],
) -> None:
    names = {service.name for service in services}
    _check_acyclic(services, waits_for)
    done = {name: threading.Event() for name in names}
    failed: list[str] = []
    errors: list[Exception] = []

    def work(service: Service) -> None:
        first = [name for name in waits_for(service) if name in names]
        for name in first:
            done[name].wait()
        broken = [name for name in first if name in failed]
        try:
            if broken and skipped:
                failed.append(service.name)
                report(f"{service.name}: {skipped} ({', '.join(broken)} failed)")
            else:
                report(action(service))
        except Exception as exc:  # raised below, in this thread's caller
            failed.append(service.name)
            errors.append(exc)
        finally:
            done[service.name].set()

    threads = [threading.Thread(target=work, args=(s,), name=s.name, daemon=True) for s in services]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if not isinstance(error, ServiceError):
            raise error  # a defect, with its traceback
    if errors:
        raise ServiceError("; ".join(str(error) for error in errors))


def _check_acyclic(services: list[Service], waits_for: Callable[[Service], tuple[str, ...]]) -> None:
    """No service waits, through others, for itself (each would wait forever)."""
    by_name = {service.name: service for service in services}
    settled: set[str] = set()
    while len(settled) < len(by_name):
        ready = [
            name
            for name, service in by_name.items()
            if name not in settled and all(n in settled or n not in by_name for n in waits_for(service))
        ]
        if not ready:
            raise ServiceError(f"services wait for each other: {', '.join(sorted(set(by_name) - settled))}")
        settled.update(ready)


def healthy(service: Service) -> bool:
    """Whether the service answers its health URL now (tcp://host:port: accepts connections)."""
    if service.health_url.startswith("tcp://"):
        host, port = service.health_url.removeprefix("tcp://").rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return True
        except OSError:
            return False
    return answers(service.health_url)


def answers(url: str) -> bool:
    """Whether `url` answers 200 within 2 s now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def running_pid(service: Service) -> int | None:
    """The pid recorded at start, if that very process still lives (its start time is recorded too, so a pid
    reused after a reboot is not mistaken for it)."""
    import psutil

    try:
        pid, started = service.pid_file.read_text().split()
        alive = psutil.Process(int(pid))
        if str(alive.create_time()) == started and alive.status() != psutil.STATUS_ZOMBIE:
            return int(pid)
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def start(service: Service, timeout_s: float = 120) -> str:
    """Start the service in the background unless it already runs; wait until it is healthy."""
    pid = running_pid(service)
    if pid is None and healthy(service):
        return f"{service.name}: already running at {service.health_url} (not started by llmopt)"
    if pid is None:
        pid = _launch(service)
        started = "started"
    else:
        started = "already running"
    deadline = time.monotonic() + timeout_s
    while not healthy(service):
        if running_pid(service) is None or time.monotonic() > deadline:
            stop(service)
            tail = service.log_file.read_text(errors="replace").strip().splitlines()[-5:]
            raise ServiceError(f"{service.name} did not start (log {service.log_file}): {' | '.join(tail)}")
        time.sleep(0.25)  # the server offers nothing to wait on but its health endpoint
    return f"{service.name}: {started}, {service.health_url} (pid {pid}, log {service.log_file})"


def _launch(service: Service) -> int:
    """Run the service's script in the background, in its own process group; record its pid and start time."""
    import psutil

    service.folder.mkdir(parents=True, exist_ok=True)
    try:
        with service.log_file.open("ab") as log:
            process = subprocess.Popen(
                [str(service.script)],
                env=_environment(service),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # `stop` signals the group: the script and the server it runs
            )
    except OSError as exc:
        raise ServiceError(f"{service.name}: cannot run {service.script}: {exc}") from None
    service.pid_file.write_text(f"{process.pid} {psutil.Process(process.pid).create_time()}\n")
    return process.pid


def _environment(service: Service) -> dict[str, str]:
    """The script's environment: ours and the service's settings, with the executables of the Python environment
    llmopt runs in first on PATH (prefect, mlflow, dask, moto_server, python): cron and systemd run
    `.venv/bin/llmopt services up` without activating the venv, and the scripts look their tools up on PATH."""
    env = {**os.environ, **service.env}
    ours = str(Path(sys.executable).parent)  # not resolved: a venv's bin/python links to the base interpreter
    rest = [folder for folder in env.get("PATH", "").split(os.pathsep) if folder and folder != ours]
    env["PATH"] = os.pathsep.join([ours, *rest])
    return env


def stop(service: Service, timeout_s: float = 20) -> str:
    """Stop the service's process group (SIGTERM, then SIGKILL after `timeout_s`)."""
    pid = running_pid(service)
    if pid is None:
        service.pid_file.unlink(missing_ok=True)
        return f"{service.name}: not running"
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running_pid(service) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    if running_pid(service) is not None:
        _signal_group(pid, signal.SIGKILL)
    service.pid_file.unlink(missing_ok=True)
    return f"{service.name}: stopped"


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.killpg(pid, signum)


def status(service: Service) -> str:
    """One line: up (and who started it), running but not answering, or down."""
    pid = running_pid(service)
    if healthy(service):
        return f"{service.name}: up at {service.health_url}" + (
            f" (pid {pid})" if pid else " (not started by llmopt)"
        )
    return f"{service.name}: " + (f"process {pid} runs but does not answer" if pid else "down")


def status_all(services: list[Service], report: Callable[[str], None]) -> None:
    """Each service's status line, in the configured order."""
    for service in services:
        report(status(service))

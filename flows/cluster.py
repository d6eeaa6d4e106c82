"""Where the pipeline's tasks run (params.yaml `cluster`): the task runner, the workspace tasks exchange bytes
through, and the routing that keeps benchmarks on benchmark workers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.params import Config
from tasks.shared_store import FolderStore

BENCHMARK_RESOURCE = "benchmark"  # Dask worker resource of the machines benchmarks may run on (1 per machine)


@dataclass(frozen=True)
class Stored:
    """A folder as the flow's machine knows it (`path`), and its key in the shared store (None: no store, the
    path is where every worker reads it)."""

    path: Path
    key: str | None = None


@dataclass(frozen=True)
class Workspace:
    """Where tasks read and write: this machine's project.workdir, or (with cluster.store) each worker's own
    folder, the bytes travelling through the store and checked against their hashes on every read."""

    workdir: Path
    store: str | None = None
    worker_dir: str = "~/.cache/llmopt/worker"

    def local(self, relative: str) -> Path:
        """Where a task on this worker writes `relative` (a build, a saved evaluation)."""
        if self.store is None:
            return self.workdir / relative
        return Path(self.worker_dir).expanduser() / relative

    def publish(self, folder: Path) -> Stored:
        """The folder, uploaded to the store when there is one (once per content)."""
        if self.store is None:
            return Stored(folder)
        return Stored(folder, FolderStore(self.store).put(folder))

    def fetch(self, stored: Stored) -> Path:
        """Where this worker reads `stored`: its path without a store, else its copy from the store (downloaded
        and checked once per content)."""
        if self.store is None or stored.key is None:
            return stored.path
        return FolderStore(self.store).get(stored.key, self.local(f"store/{stored.key}"))

    def bring_home(self, stored: Stored) -> Path:
        """`stored` at its path on the flow's machine (downloaded from the store when it is not there yet)."""
        if self.store is None or stored.key is None:
            return stored.path
        return FolderStore(self.store).get(stored.key, stored.path)


def workspace(config: Config, root: Path) -> Workspace:
    cluster = config.cluster
    store = cluster.store if cluster.runner == "dask" else None  # in one process there is nothing to exchange
    return Workspace((root / config.project.workdir).resolve(), store, cluster.worker_dir)


def task_runner(config: Config):
    """The Prefect task runner for `cluster`: one thread (tasks one after another, as measured alone), or Dask."""
    if config.cluster.runner == "local":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=1)
    import dask
    from prefect_dask import DaskTaskRunner

    # workers start each benchmark in a fresh interpreter of their own: they may not be daemonic processes
    dask.config.set({"distributed.worker.daemon": False})
    if config.cluster.dask_address:
        return DaskTaskRunner(address=config.cluster.dask_address)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={
            "n_workers": config.cluster.dask_workers,
            "threads_per_worker": 1,
            "processes": True,
            "resources": {BENCHMARK_RESOURCE: 1},
            "dashboard_address": None,
        },
    )


@contextlib.contextmanager
def on_benchmark_workers(config: Config) -> Iterator[None]:
    """Tasks submitted inside go to workers offering the `benchmark` resource (one at a time per worker)."""
    if config.cluster.runner != "dask":
        yield
        return
    import dask

    with dask.annotate(resources={BENCHMARK_RESOURCE: 1}):
        yield


def on_cluster(flow, config: Config):
    """`flow` with the task runner `cluster` asks for (call it as the flow itself)."""
    if config.cluster.runner == "dask" and not config.cluster.dask_address:
        share_prefect_api()
    return flow.with_options(task_runner=task_runner(config))


def share_prefect_api() -> None:
    """Without a Prefect server configured, the flow runs on a temporary one of its own; the workers of a local
    cluster report to that same one (otherwise every worker process would start a temporary server of its own:
    a uvicorn each, competing for the cores the builds need, and task runs the flow's API never sees)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # one per process: the flow's client uses this same instance
    server.start()
    os.environ["PREFECT_API_URL"] = server.api_url  # inherited by the worker processes started after this


def on_benchmark_worker(future, patience_s: float = 60):
    """The result of a task routed to benchmark workers (its error, if it failed). On Dask, while no worker offers
    the `benchmark` resource (none started, or the only one was lost), a warning every `patience_s`: the task
    waits for one."""
    from prefect import get_run_logger

    wrapped = getattr(future, "wrapped_future", None)
    if not hasattr(wrapped, "client"):  # this process's thread: nothing to wait for but the task itself
        return future.result()
    waited = 0.0
    while True:
        try:
            wrapped.result(timeout=patience_s)
            break
        except TimeoutError:
            waited += patience_s
        except Exception:  # the task's own error: result() below raises it, as Prefect reports it
            break
        workers = wrapped.client.scheduler_info()["workers"].values()
        if not any(BENCHMARK_RESOURCE in worker.get("resources", {}) for worker in workers):
            get_run_logger().warning(
                f"waiting {waited:.0f} s: no worker offers the `{BENCHMARK_RESOURCE}` resource (start one: "
                "DASK_RESOURCES=benchmark=1 infra/dask-worker.sh, one per benchmark machine)"
            )
    return future.result()

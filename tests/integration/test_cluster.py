"""Tracking stack and scale-out by configuration alone: `llmopt services up` starts PostgreSQL, S3 (moto), the
MLflow server on both, the Prefect server, a Prefect worker on a work pool and a Dask scheduler with 2 workers;
`llmopt schedule --once` runs the pipeline as a deployment on that pool, its tasks fanned out over Dask, the bytes
through the S3 store; runs, metrics and the registry land in PostgreSQL, artifacts in the bucket, and DVC pushes the
weights there. Then a Dask worker is SIGKILLed mid-build: the run still completes, with no second model version and
no half-written variant used. `services down` stops every service. (One stack for all: each start costs a minute.)"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

from tasks.report.timeline import Span, overlapping
from tests.integration.project import make_project, project_env, run, tiny_params

pytestmark = pytest.mark.slow
POOL = "llmopt-test"
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "llmopt",
    "AWS_SECRET_ACCESS_KEY": "llmopt",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def stack_params(model: Path, corpus: Path, pg_parent: Path, prefect_port: int, **overrides) -> dict:
    """The tiny project's params with the tracking stack on free ports (`overrides`: more sections or services)."""
    postgres, s3, mlflow = _free_ports(3)
    services = {
        "tracking_stack": True,
        "postgres_port": postgres,
        "s3_port": s3,
        "mlflow_port": mlflow,
        "prefect_port": prefect_port,
        "postgres_data": str(pg_parent / "data"),
        **overrides.pop("services", {}),
    }
    tracking = {"uri": f"http://127.0.0.1:{mlflow}", "artifacts": "mlflow-artifacts:/llmopt"}
    return tiny_params(model, corpus, services=services, tracking=tracking, **overrides)


def _free_block(size: int) -> int:
    """The first of `size` consecutive free ports (the Dask scheduler, its /health, each worker's /health)."""
    for _ in range(100):
        first = random.randint(20_000, 60_000)
        try:
            sockets = []
            for port in range(first, first + size):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no block of free ports")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir, corpus_dir):
    if shutil.which("initdb") is None and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("PostgreSQL's initdb is not installed (Debian package postgresql)")
    pg_parent = Path(tempfile.mkdtemp(prefix="llmopt-pg-"))
    pg_parent.chmod(0o755)  # as root PostgreSQL runs as the postgres user
    dask = _free_block(4)
    tmp = tmp_path_factory.mktemp("cluster")
    params = stack_params(
        tiny_model_dir,
        corpus_dir,
        pg_parent,
        _free_block(2),  # the Prefect server and its worker's health check
        services={"prefect_worker": True, "dask_workers": 2, "dask_port": dask},
        schedule={"work_pool": POOL, "cron": None, "interval_s": 86_400},
        cluster={
            "runner": "dask",
            "dask_address": f"tcp://127.0.0.1:{dask}",
            "store": "s3://llmopt-dvc/store",
            "worker_dir": str(tmp / "workers"),
        },
    )
    root = make_project(tmp / "p", params)
    s3 = f"http://127.0.0.1:{params['services']['s3_port']}"
    run(root, "dvc", "remote", "add", "-d", "-f", "s3", "s3://llmopt-dvc/cache")
    run(root, "dvc", "remote", "modify", "s3", "endpointurl", s3)
    env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": s3}
    try:
        yield root, params, env
    finally:
        run(root, "llmopt", "services", "down", check=False)
        shutil.rmtree(pg_parent, ignore_errors=True)


def test_a_deployment_on_the_work_pool_fans_out_over_dask_and_records_in_postgresql_and_s3(cluster):
    import boto3
    import psycopg

    root, params, env = cluster
    up = _output(run(root, "llmopt", "services", "up", timeout=300, env=env))
    for service in ("postgres", "s3", "mlflow-server", "prefect-server", "prefect-worker", "dask-scheduler"):
        assert f"{service}: started" in up, up
    assert "dask-worker-0: started" in up and "dask-worker-1: started" in up, up

    result = run(root, "llmopt", "schedule", "--once", timeout=900, env=env)
    assert f"on work pool {POOL}" in result.stderr
    assert "production → v1" in result.stderr.strip().splitlines()[-1], _output(result)

    spans = _timeline(root)
    builders = {s.worker for s in spans if s.kind in ("build", "evaluate")}
    assert len(builders) == 2, builders  # fanned out over both workers
    benchmarkers = {s.worker for s in spans if s.kind == "benchmark"}
    assert len(benchmarkers) == 1 and "tcp://" in next(iter(benchmarkers))  # the benchmark worker only
    assert sorted(s.name for s in spans if s.kind == "benchmark") == sorted(params["variants"])
    assert overlapping(spans) == []  # no task ran on the machine while a benchmark did

    ports = params["services"]
    assert oct(Path(ports["postgres_data"] + ".password").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(psycopg.OperationalError):  # no login without the password
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{ports['postgres_port']}/mlflow", connect_timeout=5)
    with psycopg.connect(_postgres_login(params)) as db:
        statuses = dict(db.execute("select status, count(*) from runs group by status").fetchall())
        kinds = db.execute("select value from tags where key = 'llmopt.kind'").fetchall()
        versions = db.execute("select name, version from model_versions").fetchall()
        aliases = dict(db.execute("select alias, version from registered_model_aliases").fetchall())
        metric = db.execute("select count(*) from metrics where key = 'decode_tok_s'").fetchone()[0]
    variants = len(params["variants"])
    assert statuses == {"FINISHED": 1 + variants}  # the parent run and one nested run per variant
    assert sorted(kind for (kind,) in kinds) == ["pipeline"] + ["variant"] * variants
    assert versions == [("tiny-test", 1)] and aliases == {"candidate": 1, "production": 1}
    assert metric == variants
    assert not (root / "mlflow.db").exists() and not (root / "mlruns").exists()  # nothing embedded

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **_boto(S3_CREDENTIALS))
    artifacts = [o["Key"] for o in s3.list_objects_v2(Bucket="llmopt-mlflow").get("Contents", [])]
    for artifact in ("reports/timeline.png", "report.html", "onnx_int8/model.onnx.data"):
        assert any(key.endswith(artifact) for key in artifacts), (artifact, artifacts[:20])
    stored = [o["Key"] for o in s3.list_objects_v2(Bucket="llmopt-dvc", Prefix="store/").get("Contents", [])]
    indexes = [key for key in stored if key.endswith("/llmopt-files.json")]
    assert len(indexes) == 2 + variants  # base model, data splits and every variant, once each

    # the variants the workers built are byte-identical to a build on this machine, in one process
    single = make_project(root.parent / "single", tiny_params(*_sources(params)), with_dvc=False)
    run(
        single, "llmopt", "run", env={"PREFECT_API_URL": _prefect_api(params)}
    )  # the stack's server: up already
    for name in params["variants"]:
        here = json.loads((single / f".llmopt/variants/{name}/manifest.json").read_text())["content_hash"]
        there = json.loads(
            (Path(params["cluster"]["worker_dir"]) / f"variants/{name}/manifest.json").read_text()
        )
        assert here == there["content_hash"], name

    # what the flow machine kept is versioned with DVC and pushed to the S3 remote
    run(root, "dvc", "commit", "-f", env=env)
    run(root, "dvc", "push", env=env)
    assert "in sync" in run(root, "dvc", "status", "--cloud", env=env).stdout
    pushed = s3.list_objects_v2(Bucket="llmopt-dvc", Prefix="cache/").get("Contents", [])
    assert len(pushed) >= 10, pushed


def test_a_worker_killed_mid_build_costs_a_retry_not_the_run(cluster, monkeypatch, tmp_path):
    """The first worker to reach the middle of a build SIGKILLs itself; its task moves to the other worker (or
    waits for the killed one to be restarted, as a supervisor would); the run completes and registers nothing new."""
    import boto3
    import psycopg

    from flows.services import configured_services, running_pid, start, stop
    from tasks.params_file import load_config
    from tasks.shared_store import FolderStore

    root, params, env = cluster
    # a remote cluster reports to a Prefect server its workers reach (pre-flight refuses it without one)
    env = {**env, "PREFECT_API_URL": _prefect_api(params)}
    marker = tmp_path / "killed"
    fresh = {
        "worker_dir": str(tmp_path / "workers"),
        "store": "s3://llmopt-dvc/after-kill",
    }  # build, upload again
    params = {**params, "cluster": {**params["cluster"], **fresh}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    config = load_config(root / "params.yaml")
    workers = [s for s in configured_services(config, root) if s.name.startswith("dask-worker")]
    for name, value in {**project_env(root), **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LLMOPT_FAILPOINT", "build")
    monkeypatch.setenv("LLMOPT_FAILPOINT_ONCE", str(marker))
    for worker in workers:  # restarted with the fail point armed
        stop(worker)
        start(worker)

    restarts, finished = [], threading.Event()

    def supervise() -> None:  # what systemd or Kubernetes does for a dead worker
        while not finished.wait(1):
            for worker in workers:
                if running_pid(worker) is None:
                    restarts.append(worker.name)
                    start(worker)

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        result = run(root, "llmopt", "run", timeout=900, env=env)
    finally:
        finished.set()
        supervisor.join()
    assert marker.exists()  # a worker was killed mid-build
    assert restarts, "the killed worker was not noticed"
    assert "production unchanged" in result.stdout + result.stderr  # same bytes as v1: nothing new
    mlflow_ui = f"http://127.0.0.1:{params['services']['mlflow_port']}/#/experiments/"
    assert mlflow_ui in result.stdout + result.stderr  # the run links to the tracking server's own UI
    with psycopg.connect(_postgres_login(params)) as db:
        assert db.execute("select count(*) from model_versions").fetchone()[0] == 1
    spans = _timeline(root)
    assert sorted(s.name for s in spans if s.kind == "build") == sorted(params["variants"])
    assert overlapping(spans) == []
    for name in params["variants"]:  # the killed build left nothing behind under a final name
        built = Path(params["cluster"]["worker_dir"]) / "variants" / name
        assert (built / "manifest.json").is_file() and not built.with_name(name + ".partial").exists()
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **_boto(S3_CREDENTIALS))
    listed = s3.list_objects_v2(Bucket="llmopt-dvc", Prefix="after-kill/").get("Contents", [])
    keys = [o["Key"].split("/")[1] for o in listed if o["Key"].endswith("/llmopt-files.json")]
    assert len(keys) == 2 + len(params["variants"])  # the retried build was stored once, whole
    store = FolderStore("s3://llmopt-dvc/after-kill")
    for key in keys:  # every folder the store offers reads back with all its files matching their hashes
        store.get(key, tmp_path / "check" / key)


def test_services_down_stops_every_service_it_started(cluster):
    root, params, env = cluster
    run(root, "llmopt", "services", "up", timeout=300, env=env)  # a no-op when the tests above left them up
    down = _output(run(root, "llmopt", "services", "down", env=env))
    for service in ("postgres", "s3", "mlflow-server", "prefect-server", "prefect-worker", "dask-scheduler"):
        assert f"{service}: stopped" in down, down
    for port in ("postgres_port", "s3_port", "mlflow_port", "prefect_port"):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", params["services"][port]), timeout=2).close()
    assert not any(os.path.exists(p) for p in (root / ".llmopt/services").glob("*.pid"))


def _timeline(root: Path) -> list[Span]:
    return [Span(**span) for span in json.loads((root / ".llmopt/reports/timeline.json").read_text())]


def _postgres_login(params: dict) -> str:
    ports = params["services"]
    password = Path(ports["postgres_data"] + ".password").read_text().strip()
    return f"postgresql://postgres:{password}@127.0.0.1:{ports['postgres_port']}/mlflow"


def _sources(params: dict) -> tuple[Path, Path]:
    return Path(params["model"]["source"]), Path(params["data"]["source"])


def _prefect_api(params: dict) -> str:
    return f"http://127.0.0.1:{params['services']['prefect_port']}/api"


def _output(result) -> str:
    return result.stdout + result.stderr


def _boto(credentials: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": credentials["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": credentials["AWS_SECRET_ACCESS_KEY"],
        "region_name": credentials["AWS_DEFAULT_REGION"],
    }

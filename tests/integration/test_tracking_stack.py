"""The tracking stack by configuration alone: `llmopt services up` starts PostgreSQL, an S3 endpoint (moto) and the
MLflow tracking server on both (plus the Prefect server); the pipeline, run through DVC, records its runs and
registry in PostgreSQL and its artifacts in the bucket; DVC pushes the weights to S3; `services down` stops all."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from tests.integration.project import make_project, run, tiny_params

pytestmark = pytest.mark.slow
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


@pytest.fixture
def stack_project(tmp_path, tiny_model_dir, corpus_dir):
    if shutil.which("initdb") is None and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("PostgreSQL's initdb is not installed (Debian package postgresql)")
    # As root PostgreSQL runs as the postgres user, which cannot enter pytest's private temp folders.
    pg_parent = Path(tempfile.mkdtemp(prefix="llmopt-pg-"))
    pg_parent.chmod(0o755)
    params = stack_params(tiny_model_dir, corpus_dir, pg_parent, _free_ports(1)[0])
    root = make_project(tmp_path / "p", params)
    run(root, "dvc", "remote", "add", "-d", "-f", "s3", "s3://llmopt-dvc/cache")
    s3 = f"http://127.0.0.1:{params['services']['s3_port']}"
    run(root, "dvc", "remote", "modify", "s3", "endpointurl", s3)
    try:
        yield root, params
    finally:
        run(root, "llmopt", "services", "down", check=False)
        shutil.rmtree(pg_parent, ignore_errors=True)


def test_the_pipeline_runs_on_postgresql_and_s3_by_configuration_alone(stack_project):
    import boto3
    import psycopg

    root, params = stack_project
    ports = params["services"]
    up = _output(run(root, "llmopt", "services", "up", timeout=300))
    for service in ("postgres", "s3", "mlflow-server", "prefect-server"):
        assert f"{service}: started" in up, up

    result = run(root, "dvc", "repro", timeout=900)
    assert "production → v1" in result.stdout + result.stderr
    assert f"http://127.0.0.1:{ports['mlflow_port']}/#/experiments/" in result.stdout + result.stderr
    assert not (root / "mlflow.db").exists() and not (root / "mlruns").exists()  # nothing embedded

    password_file = Path(ports["postgres_data"] + ".password")
    assert oct(password_file.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(psycopg.OperationalError):  # no login without the password
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{ports['postgres_port']}/mlflow", connect_timeout=5)
    login = (
        f"postgresql://postgres:{password_file.read_text().strip()}@127.0.0.1:{ports['postgres_port']}/mlflow"
    )
    with psycopg.connect(login) as db:
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

    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['s3_port']}", **_boto(S3_CREDENTIALS))
    artifacts = [o["Key"] for o in s3.list_objects_v2(Bucket="llmopt-mlflow").get("Contents", [])]
    assert any(key.endswith("onnx_int8/model.onnx.data") for key in artifacts), artifacts[:20]
    assert any(key.endswith("report.html") for key in artifacts), artifacts[:20]

    run(root, "dvc", "push", env=S3_CREDENTIALS)
    assert "in sync" in run(root, "dvc", "status", "--cloud", env=S3_CREDENTIALS).stdout
    pushed = s3.list_objects_v2(Bucket="llmopt-dvc").get("Contents", [])
    assert len(pushed) >= 10  # base model, splits and both variants' files

    down = _output(run(root, "llmopt", "services", "down"))
    assert all(f"{service}: stopped" in down for service in ("postgres", "s3", "mlflow-server")), down
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", ports["postgres_port"]), timeout=2).close()
    assert not any(os.path.exists(p) for p in (root / ".llmopt/services").glob("*.pid"))


def _output(result) -> str:
    return result.stdout + result.stderr


def _boto(credentials: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": credentials["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": credentials["AWS_SECRET_ACCESS_KEY"],
        "region_name": credentials["AWS_DEFAULT_REGION"],
    }

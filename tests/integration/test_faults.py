"""The fault matrix: a run SIGKILLed in each stage, a disk that fills up while a variant is written, a registry
that disappears mid-run, a `dvc push` killed half-way. After each, the next run completes; no half-written variant
is ever used; the registry holds no duplicate or dangling version; no MLflow run is left RUNNING.

The faults are chained on one project, in file order, as they would hit one user: each run is killed one stage
later than the one before, so every killed run also shows that the state the previous kill left is recovered."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.project import make_project, project_env, run, tiny_params

pytestmark = pytest.mark.slow

VARIANTS_TMPFS_MB = 256


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model_dir, corpus_dir):
    """A DVC project whose variants folder is a tmpfs of its own (so the disk-full fault can fill it)."""
    if os.geteuid() != 0:
        pytest.skip(
            "mounting a tmpfs over the variants folder needs root (CI and the dev machines run as root)"
        )
    params = tiny_params(
        tiny_model_dir,
        corpus_dir,
        variants={
            "baseline": {},
            "int8_dynamic": {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}]},
        },
    )
    root = make_project(tmp_path_factory.mktemp("faults") / "p", params)
    variants = root / ".llmopt" / "variants"
    variants.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={VARIANTS_TMPFS_MB}m", "tmpfs", str(variants)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(variants)], check=False)


def start(root: Path, *args: str, **env: str) -> tuple[subprocess.Popen, Path]:
    """`args` in the project, in a session of its own (so what it leaves behind can be killed), output to a file."""
    log = root.parent / f"out-{time.monotonic_ns()}.txt"
    process = subprocess.Popen(
        args,
        cwd=root,
        env={**project_env(root), **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, log


def kill(process: subprocess.Popen) -> None:
    """SIGKILL a process and everything it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)


def finish(process: subprocess.Popen, timeout: int = 600) -> int:
    code = process.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):  # what a killed run left running: Prefect's server, …
        os.killpg(process.pid, signal.SIGKILL)
    return code


def killed_at(root: Path, failpoint: str) -> str:
    """`llmopt run` killed by SIGKILL at `failpoint`; returns its output."""
    process, log = start(root, "llmopt", "run", LLMOPT_FAILPOINT=failpoint)
    code = finish(process)
    output = log.read_text(errors="replace")
    assert code == -signal.SIGKILL, f"not killed at {failpoint} (exit {code}):\n{output[-3000:]}"
    return output


def runs_by_status(root: Path) -> dict[str, int]:
    with sqlite3.connect(root / "mlflow.db") as db:
        return dict(db.execute("select status, count(*) from runs group by status").fetchall())


def versions(root: Path) -> list[tuple[str, str]]:
    """(version, model hash) of every registered version."""
    with sqlite3.connect(root / "mlflow.db") as db:
        rows = db.execute(
            "select v.version, t.value from model_versions v left join model_version_tags t on t.name = v.name "
            "and t.version = v.version and t.key = 'llmopt.model_hash'"
        ).fetchall()
    return [(str(version), value) for version, value in rows]


def aliases(root: Path) -> dict[str, str]:
    with sqlite3.connect(root / "mlflow.db") as db:
        return {
            alias: str(v) for alias, v in db.execute("select alias, version from registered_model_aliases")
        }


def assert_intact_variants(root: Path) -> None:
    """Every variant folder matches its manifest; nothing half-written remains under a final name."""
    from tasks.engines.manifest import verify_variant

    for folder in (root / ".llmopt" / "variants").iterdir():
        if folder.is_dir() and not folder.name.endswith(".partial"):
            verify_variant(folder)


def only_the_last_run_running(root: Path) -> None:
    statuses = runs_by_status(root)
    assert statuses.get("RUNNING") == 1, statuses  # the run just killed; every earlier one was marked
    assert set(statuses) <= {"RUNNING", "KILLED", "FINISHED", "FAILED"}, statuses


def test_killed_mid_write_in_optimize_leaves_no_variant_under_its_name(project):
    killed_at(project, "optimize")
    variants = project / ".llmopt" / "variants"
    assert any((variants / "baseline.partial").iterdir())  # killed with the weights written, manifest not
    assert not (variants / "baseline").exists()


def test_the_next_run_builds_it_afresh_and_is_killed_evaluating(project):
    killed_at(project, "evaluate")
    variants = project / ".llmopt" / "variants"
    assert (
        not (variants / "baseline.partial").exists() and (variants / "baseline" / "manifest.json").is_file()
    )
    assert_intact_variants(project)
    assert not (project / ".llmopt" / "evaluations" / "baseline.json").exists()
    only_the_last_run_running(project)


def test_the_next_run_is_killed_benchmarking(project):
    killed_at(project, "benchmark")
    assert (project / ".llmopt" / "evaluations" / "baseline.json").is_file()
    only_the_last_run_running(project)


def test_the_next_run_is_killed_registering(project):
    killed_at(project, "register")
    assert (
        len(versions(project)) == 1 and aliases(project) == {}
    )  # registered, neither candidate nor production
    only_the_last_run_running(project)


def test_a_disk_that_fills_while_a_variant_is_written_is_one_line_and_leaves_nothing_half_written(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["variants"]["onnx_fp32"] = {"steps": [{"onnx_genai": {"precision": "fp32"}}]}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    variants = project / ".llmopt" / "variants"
    process, log = start(project, "llmopt", "run")
    deadline = time.monotonic() + 300
    while not (variants / "onnx_fp32.partial").exists():  # its build started: the export takes seconds
        assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.01)
    filler = variants / "filler"
    free = os.statvfs(variants).f_bavail * os.statvfs(variants).f_frsize
    try:
        subprocess.run(
            ["fallocate", "-l", str(free), str(filler)], check=True
        )  # another writer took the rest
        code = finish(process)
    finally:
        filler.unlink(missing_ok=True)
    lines = log.read_text(errors="replace").strip().splitlines()
    assert code == 1 and "Traceback" not in "\n".join(lines), "\n".join(lines[-30:])
    assert lines[-1].startswith("error: ") and "onnx_fp32: the disk filled up while writing it" in lines[-1]
    assert not (variants / "onnx_fp32").exists() and not (variants / "onnx_fp32.partial").exists()
    assert_intact_variants(project)


def test_the_next_run_completes_through_dvc_with_one_version_per_model_and_nothing_left_running(project):
    result = run(project, "dvc", "repro")
    assert "production → v" in result.stdout + result.stderr
    statuses = runs_by_status(project)
    assert "RUNNING" not in statuses and statuses.get("KILLED") == 4, statuses
    registered = versions(project)
    hashes = [model_hash for _, model_hash in registered]
    assert len(hashes) == len(set(hashes)), registered  # the version the killed run registered was reused
    assert aliases(project)["production"] in {version for version, _ in registered}
    assert_intact_variants(project)
    assert not list((project / ".llmopt" / "variants").glob("*.partial"))


def test_a_killed_dvc_push_is_completed_by_the_next_and_the_remote_holds_exact_bytes(project):
    remote = project.parent / "dvc-remote"
    process, log = start(project, "dvc", "push", "--jobs", "1")
    while process.poll() is None and not any(p.is_file() for p in remote.rglob("*")):
        time.sleep(0.001)
    assert process.poll() is None, "dvc push ended before it could be killed"
    kill(process)  # stopped half-way: its first object was being written
    assert "in sync" not in run(project, "dvc", "status", "--cloud").stdout
    run(project, "dvc", "push")
    assert "in sync" in run(project, "dvc", "status", "--cloud").stdout
    # DVC writes each object under a temporary name and renames it when complete: a kill leaves at most such a
    # temporary file, which nothing reads. Every object under its final name must be whole.
    objects = [p for p in remote.rglob("*") if p.is_file() and not p.name.endswith((".dir", ".tmp"))]
    assert objects, "nothing was pushed"
    for path in objects:  # content-addressed: every object's name is the MD5 of its bytes
        assert hashlib.md5(path.read_bytes()).hexdigest() == path.parent.name + path.name, path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tracking_server(root: Path, port: int) -> subprocess.Popen:
    """An MLflow tracking server on the project's own store, answering on `port`."""
    server, _ = start(
        root,
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.2)


def test_a_registry_that_disappears_mid_run_stops_the_run_cleanly_and_the_next_completes(project):
    port = _free_port()
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["tracking"] = {"uri": f"http://127.0.0.1:{port}"}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    server = _tracking_server(project, port)
    before, killed_before = versions(project), runs_by_status(project).get("KILLED", 0)
    quick_failure = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    process, log = start(project, "llmopt", "run", **quick_failure)
    deadline = time.monotonic() + 300
    while "trial 1/1" not in log.read_text(errors="replace"):  # benchmarking: the registry was used already
        assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)
    kill(server)
    code = finish(process)
    lines = log.read_text(errors="replace").strip().splitlines()
    assert code == 1 and "Traceback" not in "\n".join(lines), "\n".join(lines[-30:])
    assert lines[-1].startswith("error: tracking.uri: ") and f"127.0.0.1:{port}" in lines[-1], lines[-1]

    server = _tracking_server(project, port)
    try:
        run(project, "llmopt", "run")
    finally:
        kill(server)
    statuses = runs_by_status(project)
    assert "RUNNING" not in statuses and statuses.get("KILLED") == killed_before + 1, statuses
    after = versions(project)
    assert set(before) <= set(after) and len({h for _, h in after}) == len(
        after
    )  # nothing lost, no duplicate
    assert aliases(project)["production"] in {version for version, _ in after}

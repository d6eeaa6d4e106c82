"""The fault matrix: a run SIGKILLed in each stage, a disk that fills up while a variant is written, a registry
that disappears mid-run, a `dvc push` killed half-way. After each, the next run completes; no half-written variant
is ever used; the registry holds no duplicate or dangling version; no MLflow run is left RUNNING.

The kills are one chain on one project, as they would hit one user: each run is killed one stage later than the one
before, so every killed run also shows that the state the previous kill left is recovered. The other faults each
start from a copy of the same prepared project. Every fault strikes at an exact moment, never after a timer: at a
fail point (tasks/failpoints.py) in llmopt, at a wrapped transfer in DVC's own process."""

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
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.project import ProjectStates, make_project, project_env, remote_of, run, tiny_params

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_prefect")]

VARIANTS_TMPFS_MB = 256


@pytest.fixture(scope="module")
def states(tmp_path_factory, tiny_model_dir, corpus_dir) -> ProjectStates:
    """A DVC project after `dvc repro prepare` (base model and data splits cached, no variant built yet), kept as
    state "prepared"."""
    params = tiny_params(tiny_model_dir, corpus_dir)
    params["variants"] = {  # these two only (an override would add them to tiny_params' four)
        "baseline": {},
        "int8_dynamic": {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}]},
    }
    states = ProjectStates(make_project(tmp_path_factory.mktemp("faults") / "p", params))
    run(states.root, "dvc", "repro", "prepare")
    states.save("prepared")
    return states


@pytest.fixture
def project(states) -> Path:
    """The prepared project, whatever an earlier test did to it."""
    return states.restore("prepared")


@pytest.fixture
def small_variants_disk(project) -> Iterator[Path]:
    """The project's variants folder on a tmpfs of its own, small enough for a test to fill."""
    if os.geteuid() != 0:
        pytest.skip(
            "mounting a tmpfs over the variants folder needs root (CI and the dev machines run as root)"
        )
    variants = project / ".llmopt" / "variants"
    variants.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={VARIANTS_TMPFS_MB}m", "tmpfs", str(variants)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield variants
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


def stopped(process: subprocess.Popen, log: Path, where: str, timeout_s: float = 600) -> None:
    """Wait until `process` has stopped itself (SIGSTOP) `where`, to act at exactly that moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        output = log.read_text(errors="replace")[-3000:]
        assert process.poll() is None, f"exited {process.returncode} before it stopped {where}:\n{output}"
        if psutil.Process(process.pid).status() == psutil.STATUS_STOPPED:
            return
        assert time.monotonic() < deadline, f"not stopped {where} within {timeout_s} s:\n{output}"
        time.sleep(0.05)  # polling a condition, bounded by the deadline


def resume(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGCONT)


def test_a_run_killed_in_each_stage_in_turn_is_recovered_by_the_next_and_dvc_completes_it(project):
    variants = project / ".llmopt" / "variants"

    # -- killed mid-write in optimize: no variant under its name
    killed_at(project, "build")
    assert any((variants / "baseline.partial").iterdir())  # killed with the weights written, manifest not
    assert not (variants / "baseline").exists()

    # -- the next run builds it afresh and is killed evaluating
    killed_at(project, "evaluate")
    assert (
        not (variants / "baseline.partial").exists() and (variants / "baseline" / "manifest.json").is_file()
    )
    assert_intact_variants(project)
    assert not (project / ".llmopt" / "evaluations" / "baseline.json").exists()
    only_the_last_run_running(project)

    # -- the next run is killed benchmarking
    killed_at(project, "benchmark")
    assert (project / ".llmopt" / "evaluations" / "baseline.json").is_file()
    only_the_last_run_running(project)

    # -- the next run is killed registering
    killed_at(project, "register")
    assert (
        len(versions(project)) == 1 and aliases(project) == {}
    )  # registered, neither candidate nor production
    only_the_last_run_running(project)

    # -- the next run completes through DVC, with one version per model and nothing left running
    result = run(project, "dvc", "repro")
    assert "production → v" in result.stdout + result.stderr
    statuses = runs_by_status(project)
    assert "RUNNING" not in statuses and statuses.get("KILLED") == 4, statuses
    registered = versions(project)
    hashes = [model_hash for _, model_hash in registered]
    assert len(hashes) == len(set(hashes)), registered  # the version the killed run registered was reused
    assert aliases(project)["production"] in {version for version, _ in registered}
    assert_intact_variants(project)
    assert not list(variants.glob("*.partial"))


def test_a_disk_that_fills_while_a_variant_is_written_is_one_line_and_leaves_nothing_half_written(
    project, small_variants_disk
):
    variants = small_variants_disk
    params = yaml.safe_load((project / "params.yaml").read_text())
    # the project's one ONNX export, so its fail point stops this build
    params["variants"]["onnx_fp32"] = {"steps": [{"onnx_genai": {"precision": "fp32"}}]}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    process, log = start(project, "llmopt", "run", LLMOPT_FAILPOINT="onnx_export:stop")
    filler = variants / "filler"
    try:
        stopped(process, log, "at onnx_export")  # its staging folder made, the model builder about to write
        assert (variants / "onnx_fp32.partial").is_dir()
        free = os.statvfs(variants).f_bavail * os.statvfs(variants).f_frsize
        subprocess.run(["fallocate", "-l", str(free), str(filler)], check=True)  # another writer takes it all
        resume(process)
        code = finish(process)
    finally:
        if process.poll() is None:
            kill(process)
        filler.unlink(missing_ok=True)
    lines = log.read_text(errors="replace").strip().splitlines()
    assert code == 1 and "Traceback" not in "\n".join(lines), "\n".join(lines[-30:])
    assert lines[-1].startswith("error: ") and "onnx_fp32: the disk filled up while writing it" in lines[-1]
    assert not (variants / "onnx_fp32").exists() and not (variants / "onnx_fp32.partial").exists()
    assert (variants / "baseline" / "manifest.json").is_file()  # built before the disk filled, and kept
    assert_intact_variants(project)


# `python -c STOPPING_PUSH <remote> push …` is `dvc push …` in DVC's own process, with its transfer wrapped so that
# the process stops itself (SIGSTOP) as soon as the first object lies whole in the remote, and sends the rest after
STOPPING_PUSH = """
import os, signal, sys
from dvc.cli import main
from dvc_objects.fs import generic

remote, transfer, stopped = os.path.realpath(sys.argv[1]) + os.sep, generic.transfer, False


def first_object_then_stop(from_fs, from_path, to_fs, to_path, **kwargs):
    global stopped
    sources, targets = ([path] if isinstance(path, str) else list(path) for path in (from_path, to_path))
    if stopped or not os.path.realpath(targets[0]).startswith(remote):
        return transfer(from_fs, sources, to_fs, targets, **kwargs)
    transfer(from_fs, sources[:1], to_fs, targets[:1], **kwargs)
    stopped = True
    os.kill(os.getpid(), signal.SIGSTOP)
    if sources[1:]:
        transfer(from_fs, sources[1:], to_fs, targets[1:], **kwargs)


generic.transfer = first_object_then_stop
sys.exit(main(sys.argv[2:]))
"""


def remote_objects(remote: Path) -> list[Path]:
    """The objects under their final names (DVC writes each under a temporary `.tmp` name and renames it)."""
    return [p for p in remote.rglob("*") if p.is_file() and not p.name.endswith((".dir", ".tmp"))]


def test_a_killed_dvc_push_is_completed_by_the_next_and_the_remote_holds_exact_bytes(project):
    """The prepared project's base model (weights, tokenizer) and data splits, pushed by a `dvc push` killed with
    one object sent."""
    remote = remote_of(project)
    process, log = start(project, sys.executable, "-c", STOPPING_PUSH, str(remote), "push", "--jobs", "1")
    try:
        stopped(process, log, "after its first object")
        first = remote_objects(remote)
        assert len(first) == 1, first
    finally:
        kill(process)  # half-way: one object sent, the others not
    assert "in sync" not in run(project, "dvc", "status", "--cloud").stdout
    run(project, "dvc", "push")
    assert "in sync" in run(project, "dvc", "status", "--cloud").stdout
    objects = remote_objects(remote)
    assert len(objects) > 1 and first[0] in objects, objects
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
    first_benchmark = {"LLMOPT_FAILPOINT": "benchmark:stop", "LLMOPT_FAILPOINT_TIMES": "1"}
    process, log = start(project, "llmopt", "run", **quick_failure, **first_benchmark)
    try:
        stopped(process, log, "at its first benchmark")  # the registry was used already: runs, evaluations
        kill(server)
        resume(process)
        code = finish(process)
    finally:
        if process.poll() is None:
            kill(process)
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


def test_a_disk_that_fills_while_a_version_is_registered_is_one_line_and_registers_nothing(project):
    """The winner's model logged, the disk full before its version is registered (fail point register-log:enospc):
    one line saying so, exit 1, no version, no run left RUNNING, the partial copy gone; the next run registers."""
    process, log = start(project, "llmopt", "run", LLMOPT_FAILPOINT="register-log:enospc")
    code = finish(process)
    output = log.read_text(errors="replace")
    assert code == 1, output[-3000:]
    assert "the disk filled up while registering" in output and "Traceback" not in output, output[-3000:]
    assert versions(project) == [] and "RUNNING" not in runs_by_status(project)
    assert not list((project / "mlruns").rglob("MLmodel"))  # the partial model's files are gone
    run(project, "llmopt", "run")
    assert len(versions(project)) == 1 and list((project / "mlruns").rglob("MLmodel"))

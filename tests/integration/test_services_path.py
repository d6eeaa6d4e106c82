"""`llmopt services up` as cron or systemd run it: the venv's `llmopt` by its absolute path, the venv not on PATH.
The scripts under infra/ still find prefect (mlflow, dask, moto_server) in the environment llmopt runs in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.integration.test_schedule import free_port

pytestmark = pytest.mark.slow

LLMOPT = Path(sys.executable).parent / "llmopt"  # the venv's entry point, as a crontab names it
BARE_PATH = "/usr/bin:/bin"  # cron's default PATH: no venv, no pyenv shims


def bare_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "VIRTUAL_ENV"))}
    return {**env, "PATH": BARE_PATH, "HOME": str(root)}


def llmopt(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LLMOPT), *args], cwd=root, env=bare_env(root), capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def project(tmp_path):
    port = free_port()
    params = {"project": {"name": "cron"}, "variants": {"baseline": {}}, "services": {"prefect_port": port}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    yield tmp_path, port
    llmopt(tmp_path, "services", "down")


def test_services_up_finds_prefect_in_its_own_environment_when_the_venv_is_not_on_path(project):
    root, port = project
    assert (
        subprocess.run(["sh", "-c", "command -v prefect"], env=bare_env(root)).returncode != 0
    )  # not on PATH

    up = llmopt(root, "services", "up")

    assert up.returncode == 0, up.stderr + (root / ".llmopt/services/prefect-server.log").read_text()[-2000:]
    assert f"prefect-server: started, http://127.0.0.1:{port}/api/health" in up.stderr
    assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=10).json() is True
    pid = int((root / ".llmopt/services/prefect-server.pid").read_text().split()[0])  # pid, start time
    # the script exec'd the venv's prefect (its shebang: the venv's python)
    assert psutil.Process(pid).cmdline()[1] == str(LLMOPT.with_name("prefect"))

    down = llmopt(root, "services", "down")

    assert down.returncode == 0 and "prefect-server: stopped" in down.stderr, down.stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

"""A throw-away llmopt project in a temp folder: real git, DVC, Prefect and MLflow, tiny model, tiny corpus."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Set (by tests/integration/conftest.py's `shared_prefect`) to the API of one Prefect server the module's projects
# report to, instead of each llmopt command starting (and, in a new project, migrating) an ephemeral one
SHARED_PREFECT_API = "LLMOPT_TESTS_PREFECT_API_URL"


def project_env(root: Path, ephemeral_prefect: bool = False) -> dict[str, str]:
    """The environment an llmopt command of the project runs in: none of this process's Prefect or MLflow
    settings; Prefect's ephemeral server (the user's default) unless the module shares one and not
    `ephemeral_prefect`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    shared = env.pop(SHARED_PREFECT_API, None)
    if shared and not ephemeral_prefect:
        env["PREFECT_API_URL"] = shared
    env.update(
        PATH=f"{BIN}:{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
        PYTHONPATH=str(root),
    )
    return env


def run(
    root: Path,
    *args: str,
    check: bool = True,
    timeout: int = 900,
    env: dict[str, str] | None = None,
    ephemeral_prefect: bool = False,
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        args,
        cwd=root,
        env={**project_env(root, ephemeral_prefect), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def tiny_params(model_dir: Path, corpus_dir: Path, **overrides: dict) -> dict:
    params = {
        "project": {"name": "tiny-test", "workdir": ".llmopt"},
        "model": {"source": str(model_dir)},
        "data": {
            "source": str(corpus_dir),
            "passage_words": 60,
            "min_passage_words": 20,
            "evaluation_passages": 4,
            "calibration_passages": 4,
        },
        "evaluate": {"window": 32, "max_tokens": 128},
        "benchmark": {
            "prompt_tokens": 16,
            "new_tokens": 8,
            "batch_sizes": [1, 2],
            "ttft_prompt_tokens": [8, 16],
            "requests": 4,
            "request_new_tokens": 4,
            "warmup": 1,
            "repeats": 2,
            "served_clients": [1, 3],
            "served_requests": 6,
        },
        # the served capacity's mix and batching (each a parameter of the DVC stage: present, so `dvc repro` runs)
        "loadtest": {"seed": 0, "prompt_words": [4, 30], "prompt_start": "first", "max_tokens": [3, 8]},
        "serve": {
            "max_batch": 16,
            "step_tokens": 256,
            "prefill_chunk": 0,
            "prefix_reuse": True,
            "prefix_cache_tokens": 4096,
            "max_new_tokens": 256,
        },
        "slo": None,
        "long_context": None,
        "target": {"threads": 1},
        "select": {"max_ppl_increase": 0.5},
        "variants": {
            "baseline": {},
            "bf16": {"runtime": {"dtype": "bfloat16"}},
            "int8_dynamic": {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}]},
            "onnx_int8": {"steps": [{"onnx_genai": {"precision": "int8"}}]},
        },
    }
    for section, values in overrides.items():
        params[section] = {**(params.get(section) or {}), **values} if isinstance(values, dict) else values
    return params


def make_project(root: Path, params: dict, with_dvc: bool = True) -> Path:
    """Lay out a project: code linked from this repo, the real dvc.yaml, the given params, git + DVC initialised."""
    root.mkdir(parents=True, exist_ok=True)
    for package in ("tasks", "flows", "serving"):
        (root / package).symlink_to(REPO / package)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if with_dvc:
        shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
        shutil.copy(REPO / ".gitignore", root / ".gitignore")
        run(root, "git", "init", "-q")
        run(root, "git", "config", "user.email", "ci@llmopt.invalid")
        run(root, "git", "config", "user.name", "llmopt tests")
        run(root, "dvc", "init", "-q")
        shutil.copy(REPO / ".dvcignore", root / ".dvcignore")
        run(root, "dvc", "config", "core.analytics", "false")
        run(root, "dvc", "remote", "add", "-d", "local", str(root.parent / "dvc-remote"))
        run(root, "git", "add", "-A")
        run(root, "git", "commit", "-qm", "tiny project")
    return root


def remote_of(root: Path) -> Path:
    """The folder `make_project` configures as the project's default DVC remote."""
    return root.parent / "dvc-remote"


class ProjectStates:
    """Named copies of a project and of its DVC remote, put back at the same absolute path (MLflow's store and
    DVC record absolute paths, so a copy elsewhere would be another project): one expensive run, then every test
    starts from the state it needs, whatever ran before it. A connection this process holds open to a file of
    the project (a pooled SQLite connection) goes on reading the file that was replaced."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.saved: dict[str, Path] = {}
        self.unchanged: str | None = None  # the state put back last, while it has only been read since

    def save(self, name: str) -> None:
        """Copy the project and its remote (where one exists) as state `name`, once nothing runs in it."""
        stop_processes_in(self.root.parent)
        copy = self.root.parent / f"{self.root.name}.state-{name}"
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for part in (self.root, remote_of(self.root)):
            if part.exists():
                shutil.copytree(part, copy / part.name, symlinks=True)
        self.saved[name] = copy

    def restore(self, name: str, read_only: bool = False) -> Path:
        """Stop what still runs in the project, then replace the project and its remote by state `name`.
        `read_only`: the caller only reads it, so it stays as it is when nothing changed it since the last restore."""
        if not (read_only and self.unchanged == name):
            stop_processes_in(self.root.parent)
            for part in (self.root, remote_of(self.root)):
                if part.exists():
                    shutil.rmtree(part)
                saved = self.saved[name] / part.name
                if saved.exists():
                    shutil.copytree(saved, part, symlinks=True)
        self.unchanged = name if read_only else None
        return self.root


def stop_processes_in(folder: Path) -> None:
    """SIGKILL every process working inside `folder` (what a test started there and left running: a server, a
    Prefect worker) and wait until each is gone, so that nothing writes into a project being put back."""
    import psutil

    working = []
    for process in psutil.process_iter(["cwd"]):
        cwd = process.info["cwd"]  # None where it cannot be read: another user's process, a zombie
        if process.pid != os.getpid() and cwd and Path(cwd).is_relative_to(folder):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
                working.append(process)
    _, alive = psutil.wait_procs(working, timeout=60)
    assert not alive, f"still running in {folder} after SIGKILL: {alive}"

"""Registration is keyed by model hash and atomic across processes: two processes registering the same bytes at
once (two runs of one project, or two machines on one tracking server) make one version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

REGISTER = """
import sys, mlflow
from pathlib import Path
from tasks.decide.model_registry import register_variant
from tasks.engines.manifest import read_manifest
mlflow.set_tracking_uri(sys.argv[1]); mlflow.set_registry_uri(sys.argv[1])
folder = Path(sys.argv[2])
client = mlflow.MlflowClient()
run = client.create_run(client.get_experiment_by_name("race").experiment_id).info.run_id
print("ready", flush=True)
sys.stdin.readline()  # both start registering together
registration = register_variant("race", folder, read_manifest(folder), run, {}, "raced")
print(registration.version, registration.reused)
"""


def test_two_processes_registering_the_same_bytes_at_once_make_one_version(baseline_dir, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_experiment("race", artifact_location=(tmp_path / "mlruns").as_uri())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", REGISTER, uri, str(baseline_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for process in processes:
        assert process.stdout.readline().strip() == "ready"
    for process in processes:  # both are past their imports and waiting: let them go together
        process.stdin.write("go\n")
        process.stdin.flush()
    answers = [process.communicate(timeout=300) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-2000:] for _, err in answers]
    outcomes = sorted(out.split()[-2:] for out, _ in answers)
    assert outcomes == [["1", "False"], ["1", "True"]]  # one registered it, the other found it
    assert [str(v.version) for v in client.search_model_versions("name = 'race'")] == ["1"]

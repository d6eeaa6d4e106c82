"""The deploy stage: `llmopt serve` follows the production alias on a real MLflow registry while a client keeps
sending requests: none fails, the answers switch to the new version, and a version whose bytes are corrupted is
refused while the old one keeps serving."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.project import make_project, project_env, run, tiny_params

pytestmark = pytest.mark.usefixtures("shared_prefect")
MODEL = "swap-test"


@pytest.fixture
def registry_project(tmp_path, tiny_model_dir, corpus_dir):
    """A project whose registry holds two versions of the tiny model (fp32 and bf16), production on v1."""
    import mlflow
    from mlflow import MlflowClient

    from tasks.decide.model_registry import register_variant
    from tasks.inputs.load import PreparedBase
    from tasks.local_files import folder_sha256
    from tasks.params import VariantConfig
    from tasks.techniques.build import build_variant

    params = tiny_params(tiny_model_dir, corpus_dir, project={"name": MODEL}, serve={"watch_s": 0.2})
    root = make_project(tmp_path / "project", params, with_dvc=False)
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    client = MlflowClient()
    experiment = client.create_experiment("llmopt", artifact_location=(root / "mlruns").as_uri())
    base = PreparedBase(tiny_model_dir, folder_sha256(tiny_model_dir), "tiny")
    versions = {}
    for name, variant in (
        ("baseline", VariantConfig()),
        ("bf16", VariantConfig(runtime={"dtype": "bfloat16"})),
    ):
        folder = tmp_path / "variants" / name
        manifest = build_variant(name, variant, base, "data-hash", folder)
        run_id = client.create_run(experiment).info.run_id
        versions[name] = register_variant(MODEL, folder, manifest, run_id, {}, name).version
        client.set_terminated(run_id)
    client.set_registered_model_alias(MODEL, "production", versions["baseline"])
    yield root, client, versions
    mlflow.set_tracking_uri(previous[0])
    mlflow.set_registry_uri(previous[1])


def test_a_promotion_is_swapped_in_under_load_and_a_corrupted_version_is_refused(registry_project):
    root, client, versions = registry_project
    port, log_file = _free_port(), root / "serve.log"  # a file, not a pipe: access lines would fill a pipe
    server = subprocess.Popen(
        ["llmopt", "serve", "--port", str(port)],
        cwd=root,
        env=project_env(root),
        stdout=log_file.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    answers: list[tuple[int, str]] = []  # (status, model) of every completion, in order
    swap_errors: list[str | None] = []  # /health's swap_error after each completion
    stop, changed = threading.Event(), threading.Condition()

    def keep_asking() -> None:
        body = {"prompt": "The river walks", "max_tokens": 4}
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                try:
                    reply = http.post(f"{url}/v1/completions", json=body)
                    answer = (reply.status_code, reply.json().get("model", reply.text))
                    swap_error = http.get(f"{url}/health").json()["swap_error"]
                except (httpx.HTTPError, ValueError) as exc:  # a dropped request counts as a failure
                    answer, swap_error = (0, repr(exc)), None
                with changed:
                    answers.append(answer)
                    swap_errors.append(swap_error)
                    changed.notify_all()

    def wait_for(condition, what: str) -> None:
        with changed:
            assert changed.wait_for(condition, timeout=60), f"timed out waiting for {what}"

    try:
        _wait_for_health(server, url, log_file)
        asker = threading.Thread(target=keep_asking)
        asker.start()
        wait_for(lambda: len(answers) >= 5, "answers from v1")
        run(root, "llmopt", "promote", versions["bf16"], "--force", "--reason", "hot swap under load")
        wait_for(lambda: answers[-1][1] == f"{MODEL}/{versions['bf16']}", "answers from the promoted version")
        seen = len(answers)
        wait_for(lambda: len(answers) >= seen + 5, "more answers after the swap")

        corrupted = _register_corrupted_copy(root, client, versions["bf16"])
        run(root, "llmopt", "promote", corrupted, "--force", "--reason", "a damaged upload")
        wait_for(lambda: "failed to load" in str(swap_errors[-1]), "the refusal")
        seen = len(answers)
        wait_for(lambda: len(answers) >= seen + 3, "answers after the refused swap")
        health = httpx.get(f"{url}/health").json()
        stop.set()
        asker.join(timeout=60)
    finally:
        stop.set()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    log = log_file.read_text(errors="replace")

    assert {status for status, _ in answers} == {200}, [a for a in answers if a[0] != 200][:3]
    served = [model for _, model in answers]
    switch = served.index(f"{MODEL}/{versions['bf16']}")
    assert set(served[:switch]) == {f"{MODEL}/{versions['baseline']}"}  # v1 until the swap ...
    assert set(served[switch:]) == {f"{MODEL}/{versions['bf16']}"}  # ... then v2, never back, never v3
    assert health["version"] == versions["bf16"] and f"v{corrupted} failed to load" in health["swap_error"]
    damaged = re.compile(
        r"model\.safetensors hashes to [0-9a-f]{12}, the manifest recorded [0-9a-f]{12}; refusing"
    )
    assert damaged.search(health["swap_error"]) and damaged.search(log)


def test_serve_refuses_to_start_on_a_corrupted_production_version(registry_project):
    root, client, versions = registry_project
    corrupted = _register_corrupted_copy(root, client, versions["baseline"])
    client.set_registered_model_alias(MODEL, "production", corrupted)
    result = run(root, "llmopt", "serve", "--port", str(_free_port()), check=False, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    assert lines[-1].startswith("error:") and f"{MODEL} v{corrupted}" in lines[-1]
    assert re.search(
        r"model\.safetensors hashes to [0-9a-f]{12}, the manifest recorded [0-9a-f]{12}; refusing to use it$",
        lines[-1],
    )


def test_serve_refuses_a_production_version_whose_onnx_graph_parses_wrong_though_its_hash_matches(
    registry_project, tiny_model_dir, tmp_path
):
    """An export cut short and hashed as written: the download's hash check passes, ONNX Runtime refuses the
    graph, and `serve` exits with one line naming the version, the file and ONNX Runtime's own words."""
    from tasks.decide.model_registry import register_variant
    from tasks.engines.manifest import read_manifest
    from tasks.inputs.load import PreparedBase
    from tasks.local_files import folder_sha256
    from tasks.params import VariantConfig
    from tasks.techniques.build import build_variant
    from tests.factories import damage_as_hashed

    root, client, _ = registry_project
    folder = tmp_path / "variants" / "onnx_fp32"
    base = PreparedBase(tiny_model_dir, folder_sha256(tiny_model_dir), "tiny")
    recipe = VariantConfig.model_validate({"steps": [{"onnx_genai": {"precision": "fp32"}}]})
    build_variant("onnx_fp32", recipe, base, "data-hash", folder)
    damage_as_hashed(folder, "model.onnx")
    run_id = client.create_run(client.get_experiment_by_name("llmopt").experiment_id).info.run_id
    version = register_variant(MODEL, folder, read_manifest(folder), run_id, {}, "cut short").version
    client.set_terminated(run_id)
    client.set_registered_model_alias(MODEL, "production", version)
    result = run(root, "llmopt", "serve", "--port", str(_free_port()), check=False, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    assert lines[-1].startswith("error:") and f"{MODEL} v{version}" in lines[-1], lines[-1]
    said = "ONNX Runtime cannot load this model: Load model from model.onnx failed:Protobuf parsing failed."
    assert lines[-1] == f"error: {MODEL} v{version}: {said}", lines[-1]


def _register_corrupted_copy(root: Path, client, version: str) -> str:
    """A new version carrying a copy of `version`'s artifacts with 64 bytes of its weights overwritten (what a
    damaged upload looks like); its tags, content hash included, are the original's."""
    import shutil

    source = client.get_model_version(MODEL, version)
    logged = client.get_logged_model(source.source.removeprefix("models:/"))
    damaged = Path(shutil.copytree(logged.artifact_location.removeprefix("file://"), root / "damaged-upload"))
    (weights,) = damaged.rglob("model.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    weights.write_bytes(bytes(data))
    return str(
        client.create_model_version(MODEL, damaged.as_uri(), run_id=source.run_id, tags=source.tags).version
    )


def _wait_for_health(server: subprocess.Popen, url: str, log_file: Path) -> None:
    def healthy() -> bool:
        if server.poll() is not None:
            raise AssertionError(log_file.read_text(errors="replace"))
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    deadline = time.monotonic() + 120
    while not healthy():  # a starting server offers nothing to wait on but its port
        assert time.monotonic() < deadline, "timed out waiting for the server to answer"
        time.sleep(0.05)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

"""The `register` task on a real Prefect API and a real MLflow registry (SQLite): a transient I/O fault after the
version is registered is retried 2 s and 4 s later and leaves exactly one version; a user error (a corrupted
variant folder) fails the task at its first attempt."""

from __future__ import annotations

import pytest

from tasks import failpoints
from tasks.decide.model_registry import version_tags
from tasks.errors import ArtifactError
from tasks.params import Config

MODEL = "retried"


@pytest.fixture(scope="module")
def prefect_api():
    """A temporary Prefect server for this module's task runs (their states are read back from it)."""
    from prefect.testing.utilities import prefect_test_harness

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # else "database is locked" noise in its log
        with prefect_test_harness(server_startup_timeout=180):
            yield


@pytest.fixture
def registry(tmp_path, tiny_model_dir):
    """(config, variant folder, MLflow run id) on a fresh SQLite tracking + registry store."""
    import mlflow

    from tasks.config import TrackingConfig
    from tasks.inputs.load import PreparedBase
    from tasks.local_files import folder_sha256
    from tasks.params import VariantConfig
    from tasks.report.tracking import configure_tracking
    from tasks.techniques.build import build_variant

    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    experiment_id = configure_tracking(TrackingConfig(), tmp_path)  # sqlite:///<tmp_path>/mlflow.db
    with mlflow.start_run(experiment_id=experiment_id) as run:
        run_id = run.info.run_id
    base = PreparedBase(tiny_model_dir, folder_sha256(tiny_model_dir), "tiny")
    folder = tmp_path / "variants" / "baseline"
    build_variant("baseline", VariantConfig(), base, "data-hash", folder)
    config = Config.model_validate({"project": {"name": MODEL}, "variants": {"baseline": {}}})
    yield config, folder, run_id
    mlflow.set_tracking_uri(previous[0])
    mlflow.set_registry_uri(previous[1])


def register(config: Config, folder, run_id: str):
    """The pipeline's register task, run once; its final state and its task run's state history."""
    from prefect import get_client

    from flows.pipeline import register_task
    from tasks.engines.manifest import read_manifest

    state = register_task(
        config,
        folder,
        read_manifest(folder),
        run_id,
        {"llmopt.fingerprint": "f"},
        "the winner",
        return_state=True,
    )
    from tests.model.test_serving_lifecycle import eventually

    history: list = []

    def final_state_recorded() -> bool:  # task run states reach the server as events, a moment later
        history[:] = client.read_task_run_states(state.state_details.task_run_id)
        return any(s.type == state.type for s in history)

    with get_client(sync_client=True) as client:
        eventually(final_state_recorded, "the task run's final state on the Prefect server")
    return state, sorted(history, key=lambda s: s.timestamp)


def versions() -> list:
    from mlflow import MlflowClient

    return list(MlflowClient().search_model_versions(f"name='{MODEL}'"))


def test_a_transient_registry_fault_is_retried_with_backoff_and_leaves_one_version(
    prefect_api, registry, monkeypatch
):
    config, folder, run_id = registry
    monkeypatch.setenv(failpoints.ENV, "register:oserror")
    monkeypatch.setenv(failpoints.TIMES_ENV, "2")  # the first two attempts fail, the third goes through
    monkeypatch.setattr(failpoints, "_hits", {})  # counted from this test on

    state, history = register(config, folder, run_id)

    assert state.is_completed(), state.message
    registration = state.result()
    waits = [
        (s.state_details.scheduled_time - s.timestamp).total_seconds()
        for s in history
        if s.name == "AwaitingRetry"
    ]
    assert waits == [
        pytest.approx(2, abs=0.5),
        pytest.approx(4, abs=0.5),
    ]  # exponential backoff: 2 s, then 4 s
    attempts = [s.name for s in history if s.is_running()]
    assert attempts == ["Running", "Retrying", "Retrying"]
    took = (history[-1].timestamp - history[0].timestamp).total_seconds()
    assert 6 <= took < 120  # the waits were waited (a generous bound for a loaded machine)

    registered = versions()
    assert [v.version for v in registered] == [int(registration.version)]  # the retries reused the version
    assert not registration.reused  # this run registered it: not "the same bytes as before"
    assert registered[0].description == "the winner"  # the attempt cut short after registering was finished
    assert registered[0].run_id == run_id
    assert version_tags(MODEL, registration.version)["llmopt.fingerprint"] == "f"


def test_a_corrupted_variant_folder_fails_the_register_task_without_a_retry(prefect_api, registry):
    config, folder, run_id = registry
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-16] + bytes(16))  # damaged after it was measured

    state, history = register(config, folder, run_id)

    assert state.is_failed()
    with pytest.raises(ArtifactError, match="refusing to use it"):
        state.result()
    assert [s.name for s in history if s.is_running()] == ["Running"]  # one attempt
    assert not any(s.name == "AwaitingRetry" for s in history)
    assert versions() == []

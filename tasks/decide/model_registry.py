"""register / promote: MLflow Model Registry versions and aliases, with lineage tags.

Moving `production` goes through `move_production` only: it takes the registry lock, re-reads the alias, moves
it, tags the version with the verdict and appends one history record (see `tasks.decide.history`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.decide.requirements import model_requirements
from tasks.engines.manifest import VARIANT_ARTIFACT, VariantManifest, verify_variant
from tasks.errors import RegistryError, StorageError
from tasks.failpoints import failpoint
from tasks.local_files import disk_full

CANDIDATE = "candidate"
PRODUCTION = "production"


def version_label(alias: str, version: str) -> str:
    """How a registered version is named among a run's models: `production-v3`, `candidate-v4`."""
    return f"{alias}-v{version}"


@dataclass(frozen=True)
class RegisteredVersion:
    """What `production` points to: the version and the content hash of its variant bytes."""

    version: str
    model_hash: str  # bytes + runtime settings (`VariantManifest.model_hash`); "" for versions that lack it


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    reused: bool


LOCK_SUFFIX = ".llmopt-lock"
LOCK_TIMEOUT_S = 120.0


@contextlib.contextmanager
def registry_lock(model_name: str, holder: str, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the model's registry lock for the body (waits up to `timeout_s` for another holder): every production
    move takes it (tasks/decide/history.py), and so does registering a version (find by model hash, else register:
    one atomic step for concurrent processes).

    MLflow has no compare-and-set, so breaking a dead holder's lock re-reads its token just before deleting it,
    and releasing deletes the lock only while it still carries this holder's token.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client, lock, token = MlflowClient(), model_name + LOCK_SUFFIX, uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    tags = {
        "llmopt.lock.holder": holder,
        "llmopt.lock.host": socket.gethostname(),
        "llmopt.lock.token": token,
    }
    since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tags |= {"llmopt.lock.pid": str(os.getpid()), "llmopt.lock.since": since}
    while True:
        try:
            client.create_registered_model(
                lock, tags=tags, description="llmopt: a production move is under way"
            )
            break
        except MlflowException as exc:
            # RESOURCE_DOES_NOT_EXIST: the holder released it between our create and the store's own lookup
            if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                raise RegistryError(f"{model_name}: cannot take the registry lock ({exc.message})") from None
        stale = _stale_token(client, lock)
        if stale is not None and _lock_token(client, lock) == stale:
            with contextlib.suppress(MlflowException):
                client.delete_registered_model(lock)
        if time.monotonic() > deadline:
            raise RegistryError(
                f"{model_name}: another production move or registration holds the registry lock ({lock})"
            )
        time.sleep(0.2)
    try:
        yield
    finally:
        if _lock_token(client, lock) == token:
            client.delete_registered_model(lock)


def _lock_token(client: Any, lock: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(lock).tags.get("llmopt.lock.token", "")
    except MlflowException:
        return None


def _stale_token(client: Any, lock: str) -> str | None:
    """The token of a lock whose holder ran on this host and whose process is gone (None: not stale)."""
    import psutil
    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_registered_model(lock).tags
    except MlflowException:
        return None  # released meanwhile: try again
    if tags.get("llmopt.lock.host") != socket.gethostname():
        return None
    return (
        None
        if psutil.pid_exists(int(tags.get("llmopt.lock.pid", "0")))
        else tags.get("llmopt.lock.token", "")
    )


def register_variant(
    model_name: str,
    variant_dir: Path,
    manifest: VariantManifest,
    run_id: str,
    tags: dict[str, str],
    description: str,
) -> Registration:
    """Log the variant's weights as a pyfunc model in its run and register it; identical bytes reuse a version.
    A version this same run registered (by an attempt of a retried task cut short after registering) is finished
    and returned as this run's own, so a retry never registers the variant twice."""
    from mlflow import MlflowClient

    verify_variant(
        variant_dir, f"variant {manifest.name}"
    )  # never register bytes that are not what was measured
    client = MlflowClient()
    found = _registered(client, model_name, manifest)
    if found is not None and found.run_id != run_id:
        return Registration(model_name, str(found.version), reused=True)
    if found is not None:
        version = str(found.version)  # this run registered it (an attempt cut short after registering)
    else:
        model_uri = _log_model(model_name, variant_dir, manifest, run_id)  # the slow upload, outside the lock
        # find by model hash, else register: one step under the registry lock, so two processes registering the
        # same bytes at once make one version
        with registry_lock(model_name, f"registering {manifest.name} (run {run_id})"):
            found = _registered(client, model_name, manifest)
            if found is None:
                version = _register(model_uri, model_name, manifest, tags)
        if found is not None:  # another process registered these bytes meanwhile: ours is not needed
            _drop_partial_model(run_id)
            return Registration(model_name, str(found.version), reused=found.run_id != run_id)
    # tests: SIGKILL, or a transient OSError, with the version registered but not described
    failpoint("register")
    client.update_model_version(model_name, version, description=description)
    return Registration(model_name, version, reused=False)


def _registered(client: Any, model_name: str, manifest: VariantManifest) -> Any:
    """The registered version holding `manifest`'s model (same model hash), or None."""
    return next((v for v in _versions(client, model_name) if _same_model(v.tags, manifest)), None)


def _log_model(model_name: str, variant_dir: Path, manifest: VariantManifest, run_id: str) -> str:
    """Log the variant as a pyfunc model in run `run_id`; its model URI. A disk that fills meanwhile is one
    StorageError, the partial copy removed."""
    import mlflow
    from mlflow.models import infer_signature

    try:
        with mlflow.start_run(run_id=run_id), warnings.catch_warnings():
            # the predict method has no type hints on purpose (they would replace the signature and its params)
            warnings.filterwarnings(
                "ignore", message=".*type hints to the `predict` method", category=UserWarning
            )
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(Path(__file__).with_name("pyfunc_model.py")),
                artifacts={VARIANT_ARTIFACT: str(variant_dir)},
                code_paths=[
                    str(Path(__file__).parents[1])
                ],  # the tasks package: the engines travel with the model
                pip_requirements=model_requirements(manifest, variant_dir),
                signature=infer_signature(["a prompt"], ["its completion"], params={"max_new_tokens": 64}),
            )
            failpoint("register-log")  # tests: the disk full (enospc) with the model's artifacts written
    except Exception as exc:
        if not disk_full(exc):
            raise
        _drop_partial_model(run_id)
        raise StorageError(
            f"{model_name}: the disk filled up while registering {manifest.name} (logging its model to the "
            "run's artifacts); nothing was registered and the partial copy is removed; free space where "
            "MLflow keeps artifacts (tracking.artifacts) and run again"
        ) from None
    return info.model_uri


def _register(model_uri: str, model_name: str, manifest: VariantManifest, tags: dict[str, str]) -> str:
    """Register a logged model as a new version of `model_name` with its lineage tags; the version."""
    import mlflow

    all_tags = {
        **tags,
        "llmopt.variant": manifest.name,
        "llmopt.content_hash": manifest.content_hash,
        "llmopt.model_hash": manifest.model_hash,
        "llmopt.recipe_hash": manifest.recipe_hash,
        "llmopt.base_hash": manifest.base_hash,
        "llmopt.data_hash": manifest.data_hash,
    }
    return str(mlflow.register_model(model_uri, model_name, tags=all_tags).version)


def _drop_partial_model(run_id: str) -> None:
    """Remove the models a failed registration logged in run `run_id` (their files and their entries; best effort:
    the run is marked failed anyway)."""
    from mlflow import MlflowClient
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    client = MlflowClient()
    with contextlib.suppress(Exception):
        experiment = client.get_run(run_id).info.experiment_id
        for model in client.search_logged_models([experiment], filter_string=f"source_run_id = '{run_id}'"):
            with contextlib.suppress(Exception):
                get_artifact_repository(model.artifact_location).delete_artifacts()
            with contextlib.suppress(Exception):
                client.delete_logged_model(model.model_id)


def _same_model(tags: dict[str, str], manifest: VariantManifest) -> bool:
    """A version holds this model: same model hash, or (registered before model hashes) same bytes and recipe."""
    if "llmopt.model_hash" in tags:
        return tags["llmopt.model_hash"] == manifest.model_hash
    same_bytes = tags.get("llmopt.content_hash") == manifest.content_hash
    return same_bytes and tags.get("llmopt.recipe_hash") == manifest.recipe_hash


def current_version(model_name: str, alias: str) -> str | None:
    """The version an alias points to, or None when the model or alias does not exist."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return str(MlflowClient().get_model_version_by_alias(model_name, alias).version)
    except MlflowException as exc:
        if not mlflow_refused(exc):
            raise  # the registry did not answer: no alias is not what it said
        return None


def production_version(model_name: str) -> RegisteredVersion | None:
    """The current production version (None before the first promotion)."""
    version = current_version(model_name, PRODUCTION)
    return None if version is None else registered_version(model_name, version)


def registered_version(model_name: str, version: str) -> RegisteredVersion:
    """A registered version and the content hash of its bytes (a RegistryError when it does not exist)."""
    return RegisteredVersion(version, version_tags(model_name, version).get("llmopt.model_hash", ""))


def fetch_version(model_name: str, version: RegisteredVersion, dest: Path) -> Path:
    """The variant folder of `version` in `dest`: kept when it is that version's model and its bytes still match
    their manifest, else downloaded afresh and verified (staged, so an interrupted download is never used)."""
    from tasks.engines.manifest import MANIFEST_FILE, read_manifest
    from tasks.local_files import staged_folder

    for manifest_path in dest.glob(f"**/{MANIFEST_FILE}"):
        folder, manifest = manifest_path.parent, read_manifest(manifest_path.parent)
        if manifest.model_hash == version.model_hash and bytes_hash(folder) == manifest.content_hash:
            return folder
    with staged_folder(dest) as staging:
        relative = download_verified(model_name, version.version, staging).relative_to(staging)
    return dest / relative


def bytes_hash(folder: Path) -> str:
    """SHA-256 of a variant folder's files, its manifest excepted: what the manifest and the registry record."""
    from tasks.engines.manifest import MANIFEST_FILE
    from tasks.local_files import folder_sha256

    return folder_sha256(folder, exclude=(MANIFEST_FILE,))


def download_verified(model_name: str, version: str, dest: Path) -> Path:
    """`download_version`, then its bytes checked against its manifest and the hash recorded at registration; a
    mismatch (a damaged upload, a tampered store) is a RegistryError naming the version, the file and both
    hashes."""
    from tasks.engines.manifest import integrity_problem, read_manifest

    folder = download_version(model_name, version, dest)
    recorded = version_tags(model_name, version).get("llmopt.content_hash")
    manifest = read_manifest(folder)
    problem = integrity_problem(folder, manifest)
    if problem is None and recorded and recorded != manifest.content_hash:
        problem = f"its manifest records {manifest.content_hash[:12]}, the registry recorded {recorded[:12]}"
    if problem:
        raise RegistryError(f"{model_name} v{version}: {problem}; refusing to use it")
    return folder


def set_candidate(registration: Registration) -> None:
    """Alias `candidate`: this run's winner, promoted or not."""

    set_alias(registration.name, CANDIDATE, registration.version)


def download_version(model_name: str, version: str, dest: Path) -> Path:
    """Download version `version` into `dest`; returns the folder of the variant inside it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        local = Path(
            mlflow.artifacts.download_artifacts(f"models:/{model_name}/{version}", dst_path=str(dest))
        )
    except MlflowException as exc:
        if not mlflow_refused(exc):
            raise  # the registry or the artifact store failed to answer: the fetch task's retries are for that
        raise RegistryError(f"{model_name} version {version}: {str(exc).splitlines()[0]}") from None
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    try:
        relative = mlmodel["flavors"]["python_function"]["artifacts"][VARIANT_ARTIFACT]["path"]
    except (KeyError, TypeError):
        raise RegistryError(f"{model_name} version {version} was not logged by llmopt") from None
    return local / relative


def version_tags(model_name: str, version: str) -> dict[str, str]:
    """The tags of one model version (content hash, lineage, gate verdict)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return dict(MlflowClient().get_model_version(model_name, version).tags)
    except MlflowException as exc:
        if not mlflow_refused(exc):
            raise
        raise RegistryError(f"no version {version} of {model_name} in the registry") from None


def tag_version(model_name: str, version: str, key: str, value: str) -> None:
    """Set one tag on a model version (shown on its page in the MLflow UI)."""
    from mlflow import MlflowClient

    MlflowClient().set_model_version_tag(model_name, version, key, value)


def untag_version(model_name: str, version: str, key: str) -> None:
    """Remove one tag from a model version (absent already: nothing to do)."""
    from mlflow import MlflowClient

    with contextlib.suppress(Exception):
        MlflowClient().delete_model_version_tag(model_name, version, key)


def model_tags(model_name: str, unanswered_is_missing: bool = False) -> dict[str, str] | None:
    """The registered model's own tags (history records, an unfinished move), or None when it is not registered
    (MLflow refused the request). A registry that failed to answer raises (a retry may get past it), unless
    `unanswered_is_missing`: then that is None too."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return dict(MlflowClient().get_registered_model(model_name).tags)
    except MlflowException as exc:
        if unanswered_is_missing or mlflow_refused(exc):
            return None
        raise


def tag_model(model_name: str, key: str, value: str | None) -> None:
    """Set one tag of the registered model, or delete it (`value` None)."""
    from mlflow import MlflowClient

    if value is None:
        MlflowClient().delete_registered_model_tag(model_name, key)
    else:
        MlflowClient().set_registered_model_tag(model_name, key, value)


def set_alias(model_name: str, alias: str, version: str) -> None:
    """Point `alias` at `version` (callers moving production hold the registry lock)."""
    from mlflow import MlflowClient

    MlflowClient().set_registered_model_alias(model_name, alias, version)


def version_run_metrics(model_name: str, version: str) -> dict[str, float]:
    """The metrics of the pipeline run that registered this version (empty when it records no run)."""
    from mlflow import MlflowClient

    client = MlflowClient()
    run_id = client.get_model_version(model_name, version).run_id
    return dict(client.get_run(run_id).data.metrics) if run_id else {}


def _versions(client, model_name: str) -> list:
    from mlflow.exceptions import MlflowException

    try:
        return list(client.search_model_versions(f"name='{model_name}'"))
    except MlflowException as exc:
        if not mlflow_refused(exc):
            raise  # an empty answer here would register the variant a second time
        return []


def mlflow_refused(exc) -> bool:
    """Whether MLflow refused a request (a 4xx answer: no such model or version, a bad name), which is the user's
    to fix, rather than failed to carry it out (5xx, 429 or no answer at all), which a retry may get past."""
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status != 429


def mlflow_retryable(exc: BaseException) -> bool | None:
    """For an MLflow error, whether a retry may get past it (it was not refused); None for any other error."""
    from mlflow.exceptions import MlflowException

    return not mlflow_refused(exc) if isinstance(exc, MlflowException) else None

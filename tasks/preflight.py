"""Pre-flight: everything that can be checked before work starts is checked at once, and every problem found is
reported together (exit code 2), instead of the first one surfacing after minutes of model conversion."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse

from tasks.config import DataConfig, TrackingConfig
from tasks.errors import ConfigError, LlmoptError
from tasks.params import Config

# MLflow stores llmopt has been run against; anything else is refused before work starts.
TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql")
ARTIFACT_SCHEMES = ("", "file", "s3", "mlflow-artifacts")  # mlflow-artifacts: proxied by the tracking server
REACH_TIMEOUT_S = 3.0
LOCAL = ("127.0.0.1", "localhost", "::1")


class PreflightError(ConfigError):
    """One or more things a run needs are missing or unreachable (all of them named in one message)."""


def preflight(
    config: Config, root: Path, extra: Sequence[Callable[[Config], None]] = (), starts_services: bool = False
) -> None:
    """Run every check (and the command's `extra` ones); raise one PreflightError naming all problems, or return
    when the run can start. `starts_services`: the command starts the configured services itself (`llmopt
    schedule`), so the tracking stack's server is not expected to answer yet."""
    from tasks.inputs.load import check_model_source
    from tasks.targets import check_target

    checks: list[Callable[[], None]] = [
        lambda: check_target(config),
        lambda: check_model_source(config.model),
        lambda: check_data_source(config.data, root / config.project.downloads),
        lambda: check_tracking(
            config.tracking, root, reach=not (starts_services and config.services.tracking_stack)
        ),
        lambda: check_dvc_remote(root),
        lambda: check_disk_space(config, root),
        lambda: check_cluster(config, reach=not (starts_services and config.services.dask_workers)),
    ]
    if config.long_context:
        checks.append(lambda: check_long_documents(config, root / config.project.downloads))
    if config.evaluate.lm_eval_tasks:
        from tasks.measure.lm_eval_adapter import require_lm_eval

        checks.append(require_lm_eval)
    checks += [lambda check=check: check(config) for check in extra]
    problems = []
    for check in checks:
        try:
            check()
        except LlmoptError as exc:
            problems.append(str(exc))
    if len(problems) == 1:
        raise PreflightError(problems[0])
    if problems:
        raise PreflightError(f"{len(problems)} problems, nothing started: " + "; ".join(problems))


def check_data_source(cfg: DataConfig, downloads: Path) -> None:
    """The corpus can be read: the fetched Brown tarball, a hub dataset id, or a local file/folder."""
    from tasks.inputs.data import BROWN, BROWN_TARBALL, HUB_PREFIX

    if cfg.source == BROWN:
        if not (downloads / BROWN_TARBALL).is_file():
            raise ConfigError(f"data.source: brown needs {downloads / BROWN_TARBALL}; run `make corpus`")
    elif cfg.source.startswith(HUB_PREFIX):
        if "/" not in cfg.source.removeprefix(HUB_PREFIX).strip("/"):
            raise ConfigError(f"data.source: {cfg.source!r} is not a hub dataset id (hf:owner/name)")
    elif not Path(cfg.source).exists():
        raise ConfigError(f"data.source: {cfg.source} does not exist")
    else:
        from tasks.inputs.data import LOCAL_SUFFIXES, local_text_files, read_local

        if not local_text_files(Path(cfg.source)):
            raise ConfigError(
                f"data.source: {cfg.source} holds no text files ({', '.join(LOCAL_SUFFIXES)}) and is not a .jsonl file"
            )
        read_local(Path(cfg.source), cfg.text_column)  # every file decodes (one bad file is named)


def check_long_documents(config: Config, downloads: Path) -> None:
    """`long_context`'s source is there and the model is not split over ranks (its incremental sequence runs on one
    process); a length longer than the model's positions is named once the base model is prepared."""
    from tasks.inputs.long_documents import KJV, KJV_SDIST

    cfg = config.long_context
    if config.target.tensor_parallel > 1:
        raise ConfigError(
            "long_context: not measured on a model split over ranks (target.tensor_parallel > 1)"
        )
    if cfg.source == KJV and not (downloads / KJV_SDIST).is_file():
        raise ConfigError(f"long_context.source: kjv needs {downloads / KJV_SDIST}; run `make corpus`")
    if cfg.source != KJV and not Path(cfg.source).exists():
        raise ConfigError(f"long_context.source: {cfg.source} does not exist")


def check_tracking(cfg: TrackingConfig, root: Path, reach: bool = True) -> None:
    """The tracking/registry store's scheme is one llmopt supports and, for a server, it answers (`reach`)."""
    scheme = urlparse(cfg.uri).scheme
    if scheme not in TRACKING_SCHEMES:
        raise ConfigError(
            f"tracking.uri: scheme {scheme or '(none)'}:// is not supported; use one of {', '.join(TRACKING_SCHEMES)}"
        )
    if reach and scheme in ("http", "https", "postgresql", "mysql"):
        _reachable("tracking.uri", cfg.uri)
    artifact_scheme = urlparse(cfg.artifacts).scheme
    if artifact_scheme not in ARTIFACT_SCHEMES:
        raise ConfigError(
            f"tracking.artifacts: scheme {artifact_scheme}:// is not supported; use a folder, s3:// or "
            "mlflow-artifacts:/ (stored by the tracking server)"
        )
    if artifact_scheme == "mlflow-artifacts" and scheme not in ("http", "https"):
        raise ConfigError(
            "tracking.artifacts: mlflow-artifacts:/ needs a tracking server (tracking.uri: http://…)"
        )


def _reachable(key: str, uri: str) -> None:
    parsed = urlparse(uri)
    default_port = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306}[parsed.scheme]
    host, port = parsed.hostname or "localhost", parsed.port or default_port
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        hint = (
            " (a local tracking stack: services.tracking_stack, `llmopt services up`)"
            if host in LOCAL
            else ""
        )
        raise ConfigError(f"{key}: nothing answers at {host}:{port} ({exc.strerror or exc}){hint}") from None


def check_cluster(config: Config, reach: bool = True) -> None:
    """The Dask scheduler of cluster.dask_address answers (`reach`), and the store's scheme is one fsspec knows."""
    cluster = config.cluster
    address = urlparse(cluster.dask_address or "")
    if cluster.runner == "dask" and address.scheme in ("tcp", "tls") and reach:
        host = address.hostname or "localhost"
        try:
            port = address.port or 8786  # Dask's default
            socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            hint = " (a local cluster: services.dask_workers, `llmopt services up`)" if host in LOCAL else ""
            raise ConfigError(
                f"cluster.dask_address: nothing answers at {cluster.dask_address} ({exc}){hint}"
            ) from None
    if cluster.runner == "dask" and cluster.dask_address and not _prefect_api_url():
        raise ConfigError(
            f"cluster.dask_address: the workers of {cluster.dask_address} need a Prefect server they can reach; "
            "set PREFECT_API_URL (e.g. http://HOST:4200/api for the server `llmopt services up` starts)"
        )
    if cluster.store:
        import fsspec

        protocol = cluster.store.split("://", 1)[0] if "://" in cluster.store else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"cluster.store: {cluster.store!r} is not a store llmopt can reach ({exc})"
            ) from None


def _prefect_api_url() -> str | None:
    """The Prefect API this process talks to: the environment's or the active profile's PREFECT_API_URL."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def check_dvc_remote(root: Path) -> None:
    """In a DVC project, a default remote is configured (the pipeline's weights are pushed there)."""
    import configparser

    if not (root / ".dvc").is_dir():
        return  # llmopt run outside DVC: nothing is pushed
    parser = configparser.ConfigParser()
    parser.read([root / ".dvc" / "config", root / ".dvc" / "config.local"])
    if not parser.get("core", "remote", fallback=None):
        raise ConfigError("DVC: no default remote; add one with `dvc remote add -d <name> <url>`")


def check_disk_space(config: Config, root: Path) -> None:
    """Room in the work folder for the variants still to build, each counted at the base model's fp32 size
    (the largest a variant gets); skipped before the first run, when that size is not known yet."""
    from tasks.local_files import folder_size

    workdir = root / config.project.workdir
    base, variants = workdir / "base", workdir / "variants"
    if not base.is_dir():
        return
    missing = [name for name in config.variants if not (variants / name / "manifest.json").is_file()]
    needed = folder_size(base) * len(missing)
    where = variants if variants.is_dir() else workdir  # the variants folder may be a mount of its own
    free = shutil.disk_usage(where).free
    if needed > free:
        raise ConfigError(
            f"disk: {len(missing)} variants to build need about {needed / 1e9:.1f} GB in {where}, "
            f"{free / 1e9:.1f} GB free"
        )

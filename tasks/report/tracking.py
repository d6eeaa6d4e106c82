"""tracking: one MLflow parent run per pipeline run, one nested run per variant (explicit run ids, no globals), and
run hygiene (which process owns a run, runs of dead processes marked KILLED, an unreachable server told apart).

Every MLflow tracking read and write goes through this module (the Model Registry's through
tasks/decide/model_registry.py); the leaderboard's files are leaderboard_files.py's."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tasks.config import TrackingConfig
from tasks.decide.long_context import length_metrics, retrieval_metrics, speed_metrics
from tasks.decide.select import Leaderboard
from tasks.engines.manifest import VariantManifest
from tasks.errors import exception_chain
from tasks.measure.benchmark import BenchmarkResult
from tasks.measure.evaluate import VariantEvaluation
from tasks.measure.served import served_metrics
from tasks.measure.served_lengths import capacity_metrics
from tasks.params import Config
from tasks.report.plots import precision_plot
from tasks.report.recipe_params import flatten as _flatten
from tasks.report.recipe_params import recipe_params


def tracking_uri(cfg: TrackingConfig, root: Path) -> str:
    """The tracking URI with a relative sqlite path anchored at the project root (not the caller's cwd)."""
    prefix = "sqlite:///"
    if cfg.uri.startswith(prefix) and not cfg.uri.startswith(prefix + "/"):
        return prefix + str((root / cfg.uri.removeprefix(prefix)).resolve())
    return cfg.uri


def configure_tracking(cfg: TrackingConfig, root: Path) -> str:
    """Point MLflow (tracking and registry) at the configured store; return the experiment id."""
    import mlflow

    uri = tracking_uri(cfg, root)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    experiment = mlflow.get_experiment_by_name(cfg.experiment)
    if experiment is None:
        # s3://, mlflow-artifacts:/, file://… are used as given (a one-letter scheme is a Windows drive)
        stored_elsewhere = len(urlparse(cfg.artifacts).scheme) > 1
        artifacts = cfg.artifacts if stored_elsewhere else (root / cfg.artifacts).resolve().as_uri()
        experiment_id = mlflow.create_experiment(cfg.experiment, artifact_location=artifacts, tags=VIEW_TAGS)
    else:
        experiment_id = experiment.experiment_id
        if any(experiment.tags.get(key) != value for key, value in VIEW_TAGS.items()):
            for key, value in VIEW_TAGS.items():  # experiments made by older llmopt releases get the view too
                mlflow.MlflowClient().set_experiment_tag(experiment_id, key, value)
    return experiment_id


# The MLflow UI (3.x) opens experiments on its GenAI pages unless told otherwise; llmopt's runs are model
# development. A shared view preselects the columns people compare variants by, fastest first (nested variant
# runs show as rows when sorted by a metric). Open it with `experiment_url`.
VIEW_KEY = "llmopt"
_VIEW_COLUMNS = [
    *(f"params.`{p}`" for p in ("technique", "weight_bits", "engine", "dtype")),
    *(
        f"metrics.`{m}`"
        for m in ("decode_tok_s", "speedup", "ppl_ratio", "ppl_ratio_ci_high", "cloze_accuracy")
    ),
    *(f"metrics.`{m}`" for m in ("ttft_ms", "peak_rss_mb", "size_mb", "within_budget")),
]
VIEW_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    f"mlflow.sharedViewState.{VIEW_KEY}": json.dumps(
        {
            "name": "llmopt variants",
            "createdAt": 0,
            "state": json.dumps(
                {
                    "selectedColumns": _VIEW_COLUMNS,
                    "orderByKey": "metrics.`decode_tok_s`",
                    "orderByAsc": False,
                }
            ),
        }
    ),
}


DEFAULT_UI = "http://127.0.0.1:5000"  # where `make ui` serves the MLflow UI


def log_run_report(parent_run_id: str, files: list[Path], metrics: dict[str, float]) -> None:
    """The run report as parent-run artifacts (reports/) and the stage timings as parent-run metrics."""
    from mlflow import MlflowClient

    client = MlflowClient()
    for path in files:
        client.log_artifact(parent_run_id, str(path), artifact_path="reports")
    for key, value in metrics.items():
        client.log_metric(parent_run_id, key, value)


def log_standalone_run(
    experiment: str, name: str, tags: dict[str, str], params: dict[str, Any], metrics: dict[str, float]
) -> str:
    """One MLflow run outside the pipeline's (a load test, a peer comparison) in `experiment`: its tags, params and
    metrics (a nan is not logged: not measured). Returns the run id."""
    import mlflow

    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=name) as run:
        mlflow.set_tags(tags)
        mlflow.log_params(params)
        mlflow.log_metrics({key: float(value) for key, value in metrics.items() if value == value})
    return run.info.run_id


def log_nested_run(
    experiment_id: str,
    parent_run_id: str,
    name: str,
    tags: dict[str, str],
    params: dict[str, Any],
    metrics: dict[str, float],
) -> str:
    """A finished run nested under `parent_run_id` (a search's trial): tags, params, metrics (nan: not logged)."""
    import time

    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient()
    nested = {"mlflow.parentRunId": parent_run_id, **tags, **process_tags()}
    run_id = client.create_run(experiment_id, run_name=name, tags=nested).info.run_id
    stamp = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), stamp, 0) for k, v in metrics.items() if v == v],
        params=[Param(k, str(v)[:6000]) for k, v in params.items()],
    )
    client.set_terminated(run_id, "FINISHED")
    return run_id


def ui_base() -> tuple[str, str]:
    """(where the MLflow UI of the current store is, how to open it): the tracking server itself when there is
    one, else `make ui` on the embedded store."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    return (
        (uri, "the tracking server") if uri.startswith(("http://", "https://")) else (DEFAULT_UI, "make ui")
    )


def experiment_url(ui: str, experiment_id: str) -> str:
    """The MLflow UI's runs table of the experiment, with llmopt's column view (`ui`: e.g. http://127.0.0.1:5000)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}&workflowType=machine_learning"


@dataclass(frozen=True)
class ParentRun:
    """A pipeline run's MLflow parent run: the experiment it is in and its id (variant runs nest under it)."""

    experiment_id: str
    run_id: str


@contextlib.contextmanager
def parent_run(
    experiment_id: str,
    config: Config,
    lineage: dict[str, str],
    fingerprint: dict[str, Any],
    kind: str = "pipeline",
) -> Iterator[ParentRun]:
    """The pipeline's parent run: settings, input hashes and fingerprint logged up front, FAILED if the body raises."""
    from mlflow import MlflowClient
    from mlflow.entities import Param

    client = MlflowClient()
    mark_ghost_runs(experiment_id)
    tags = {"llmopt.kind": kind, **process_tags()}
    run = client.create_run(experiment_id, run_name=f"{kind}-{config.project.name}", tags=tags)
    run_id = run.info.run_id
    try:
        client.log_dict(run_id, config.model_dump(mode="json"), "config.json")
        client.log_dict(run_id, fingerprint, "fingerprint.json")
        client.set_tag(run_id, "llmopt.fingerprint", str(fingerprint["hash"]))
        params = {**_flatten(config.model_dump(mode="json", exclude={"variants"})), **lineage}
        params["variants"] = ",".join(config.variants)
        client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        yield ParentRun(experiment_id, run_id)
    except BaseException:
        # the store may be gone too: then the next run marks this run KILLED (mark_ghost_runs)
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")


def log_variant_run(
    experiment_id: str,
    parent_run_id: str,
    manifest: VariantManifest,
    evaluation: VariantEvaluation,
    bench: BenchmarkResult,
    fingerprint_hash: str,
) -> str:
    """One nested run per variant: recipe as params, accuracy/speed/memory as metrics, manifest as artifact."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient()
    tags = {"llmopt.fingerprint": fingerprint_hash, "llmopt.benchmark": "short" if bench.short else "full"}
    run = _create_variant_run(client, experiment_id, parent_run_id, manifest.name, tags)
    params = {**recipe_params(manifest), "fingerprint": fingerprint_hash}
    metrics = {
        "perplexity": evaluation.perplexity.perplexity,
        "eval_tokens": evaluation.perplexity.predicted_tokens,
        "token_agreement": evaluation.agreement.token_agreement,
        "exact_match": evaluation.agreement.exact_match,
        "cloze_accuracy": evaluation.cloze.accuracy,
        **{f"lm_eval.{name}": value for name, value in evaluation.lm_eval.items()},
        "decode_tok_s": bench.decode_tok_s,
        "decode_tok_s_ci_low": bench.decode_tok_s_ci[0],
        "decode_tok_s_ci_high": bench.decode_tok_s_ci[1],
        **{f"decode_tok_s_bs{b.batch_size}": b.decode_tok_s for b in bench.batches},
        **{f"tpot_ms_bs{b.batch_size}": b.tpot_ms for b in bench.batches},
        **{f"ttft_ms_prompt{n}": ms for n, ms in bench.ttft_ms_by_prompt.items()},
        **{f"latency_ms_{q}": ms for q, ms in bench.latency_ms.items()},
        "weight_mb": bench.weight_bytes / 1e6,
        "decode_read_mb": bench.decode_read_bytes / 1e6,
        "ttft_ms": bench.ttft_ms,
        "load_s": bench.load_s,
        "peak_rss_mb": bench.peak_rss_mb,
        **({"peak_gpu_mb": bench.peak_gpu_mb} if bench.peak_gpu_mb is not None else {}),
        "first_call_s": bench.first_call_s,
        **({"compile_s": bench.compile_s} if bench.compile_s is not None else {}),
        "size_mb": manifest.size_bytes / 1e6,
        "parameters": manifest.parameters,
        **_mixed_precision_metrics(manifest.mixed_precision),
        **{
            f"speculative.{style.style}.{name}": getattr(style, name)
            for style in bench.speculation or []
            for name in (
                "ratio",
                "acceptance",
                "tokens_per_call",
                "agreement",
                "plain_tok_s",
                "speculative_tok_s",
            )
        },
        **_served_metrics(bench),
    }
    curves = [
        Metric(key, float(value), 0, step)
        for key, values in manifest.training.items()
        for step, value in enumerate(values, start=1)
    ]  # training losses (distillation, healing) as per-step series: the MLflow UI draws them as curves
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()],
        params=[Param(k, str(v)[:6000]) for k, v in params.items()],
    )
    for start in range(0, len(curves), 1000):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run.info.run_id, metrics=curves[start : start + 1000])
    client.log_dict(run.info.run_id, asdict(manifest), "manifest.json")
    client.log_dict(run.info.run_id, asdict(bench), "benchmark.json")
    client.log_dict(run.info.run_id, asdict(evaluation.perplexity), "evaluation.json")
    client.log_dict(run.info.run_id, asdict(evaluation.agreement), "agreement.json")
    if manifest.mixed_precision:
        client.log_dict(run.info.run_id, manifest.mixed_precision, "mixed_precision.json")
        with tempfile.TemporaryDirectory() as scratch:
            picture = precision_plot(manifest.mixed_precision, Path(scratch) / "mixed_precision.png")
            client.log_artifact(run.info.run_id, str(picture))
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def log_failed_variant_run(
    experiment_id: str, parent_run_id: str, manifest: VariantManifest, stage: str, message: str
) -> str:
    """A nested run, status FAILED, for a variant its engine could not run: its recipe as params, the stage and
    the engine's refusal as tags (`llmopt.failure`), its manifest as an artifact; no metrics."""
    from mlflow import MlflowClient
    from mlflow.entities import Param

    client = MlflowClient()
    tags = {"llmopt.failed_stage": stage, "llmopt.failure": message[:5000]}
    run = _create_variant_run(client, experiment_id, parent_run_id, manifest.name, tags)
    client.log_batch(
        run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in recipe_params(manifest).items()]
    )
    client.log_dict(run.info.run_id, asdict(manifest), "manifest.json")
    client.set_terminated(run.info.run_id, "FAILED")
    return run.info.run_id


def _create_variant_run(client: Any, experiment_id: str, parent_run_id: str, name: str, tags: dict[str, str]):
    """A variant's nested run under the parent, tagged as one (plus `tags`)."""
    kind = {"mlflow.parentRunId": parent_run_id, "llmopt.kind": "variant", "llmopt.variant": name}
    return client.create_run(experiment_id, run_name=name, tags={**kind, **tags, **process_tags()})


def _served_metrics(bench: BenchmarkResult) -> dict[str, float]:
    """Served capacity per client count and by window length (the leaderboard's names), and the serving decoder's
    peak memory."""
    metrics = served_metrics(bench.served or ()) | capacity_metrics(bench.served_by_length or ())
    if bench.served_peak_rss_mb is not None:
        metrics["served_peak_rss_mb"] = bench.served_peak_rss_mb
    return metrics


def _mixed_precision_metrics(plan: dict[str, Any]) -> dict[str, float]:
    """The search's figures on the calibration split (the evaluation's perplexity is logged beside them)."""
    if not plan:
        return {}
    return {
        "mixed_precision.int8_matrices": sum(1 for m in plan["matrices"] if m["bits"] == 8),
        "mixed_precision.calibration_ppl_increase": plan["measured_ppl_increase"],
        "mixed_precision.predicted_ppl_increase": plan["predicted_ppl_increase"],
        "mixed_precision.int4_ppl_increase": plan["int4_ppl_increase"],
        "mixed_precision.size_ratio": plan["size_ratio"],
    }


def log_reports(
    parent_run_id: str,
    board: Leaderboard,
    reports: list[Path],
    variant_runs: dict[str, str],
    run_metrics: dict[str, float],
) -> None:
    """Report files as parent-run artifacts, the winner as a tag, comparisons with the baseline on each variant run."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient()
    for row in board.rows:
        comparison = {
            "ppl_ratio": row.ppl_ratio,
            "ppl_ratio_ci_low": row.ppl_ratio_low,
            "ppl_ratio_ci_high": row.ppl_ratio_high,
            "speedup": row.speedup,
            "roofline_fraction": row.score.roofline_fraction,
            "cloze_p_value": row.cloze_p_value,
            "cloze_delta": row.cloze_delta,
            "within_budget": float(row.within_budget),
            **length_metrics(row.long_context),
            **retrieval_metrics(row.score.retrieval),
            **speed_metrics(row.score.speed_at_length, row.score.roofline_at_length),
        }
        metrics = [Metric(k, float(v), 0, 0) for k, v in comparison.items()]
        client.log_batch(variant_runs[row.score.variant], metrics=metrics)
    for path in reports:
        client.log_artifact(parent_run_id, str(path), artifact_path="reports")
    client.set_tag(parent_run_id, "llmopt.winner", board.winner or "none")
    client.set_tag(parent_run_id, "llmopt.selection", board.reason[:5000])
    if board.winner is not None:
        winner = board.row(board.winner)
        client.log_metric(parent_run_id, "winner_decode_tok_s", winner.score.decode_tok_s)
        client.log_metric(parent_run_id, "winner_speedup", winner.speedup)
        client.log_metric(parent_run_id, "winner_ppl_ratio", winner.ppl_ratio)
    for key, value in run_metrics.items():
        client.log_metric(parent_run_id, key, value)


# --- run hygiene ------------------------------------------------------------------------------------------------


def tracking_unreachable(exc: BaseException) -> str | None:
    """The one-line story of an MLflow call that failed because the tracking server stopped answering, or None
    for any other failure (only for a tracking server, and only when the error names its address)."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or parsed.hostname is None:
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    for error in exception_chain(exc):
        text = str(error)
        about_the_server = f"{parsed.hostname}:{port}" in text or f"port={port}" in text
        if about_the_server and any(sign in text for sign in ("Max retries exceeded", "Connection refused")):
            return (
                f"tracking.uri: {uri} stopped answering, and the run stopped there (start the tracking server "
                "and run again: the next run marks this one KILLED; `llmopt history` shows whether production moved)"
            )
    return None


def process_tags() -> dict[str, str]:
    """Where a run runs: the host and the process (id and start time, so a reused pid is not mistaken for it)."""
    import socket

    import psutil

    me = psutil.Process()
    return {
        "llmopt.host": socket.gethostname(),
        "llmopt.pid": str(me.pid),
        "llmopt.pid_started": str(me.create_time()),
    }


def mark_ghost_runs(experiment_id: str) -> list[str]:
    """Runs left RUNNING by a process of this host that is gone (killed, SIGKILL included) become KILLED."""
    import socket

    import psutil
    from mlflow import MlflowClient

    client, host, ghosts = MlflowClient(), socket.gethostname(), []
    running = client.search_runs(
        [experiment_id], f"attributes.status = 'RUNNING' and tags.`llmopt.host` = '{host}'", max_results=1000
    )
    for run in running:
        pid, started = int(run.data.tags.get("llmopt.pid", "0")), run.data.tags.get("llmopt.pid_started")
        try:
            alive = str(psutil.Process(pid).create_time()) == started
        except (psutil.NoSuchProcess, ValueError):
            alive = False
        if not alive:
            client.set_terminated(run.info.run_id, "KILLED")
            ghosts.append(run.info.run_id)
    return ghosts


def import_mlflow() -> None:
    """Import MLflow now (it installs its log handlers on import: whoever routes the logs imports it first)."""
    import mlflow  # noqa: F401

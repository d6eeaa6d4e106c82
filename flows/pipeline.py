"""The pipeline flow: load → data → (optimize → evaluate → benchmark) per variant → select → register → promote."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.progress import progress_bar
from tasks.benchmark import (
    BenchmarkResult,
    benchmark_in_fresh_process,
    memory_read_bandwidth_gbs,
    roofline_fraction,
)
from tasks.config import Config, VariantConfig
from tasks.data import PreparedData, prepare_data, read_split
from tasks.evaluate import (
    VariantEvaluation,
    evaluate_variant,
    evaluation_key,
    load_evaluation,
    save_evaluation,
)
from tasks.expectations import validate_metrics_table
from tasks.fingerprint import machine_fingerprint
from tasks.load import BaseModel, prepare_base_model
from tasks.manifest import VariantManifest
from tasks.optimize import build_variant
from tasks.registry import Registration, gate_verdict, promote, register_variant
from tasks.runtime import load_runtime
from tasks.select import Leaderboard, VariantScore, build_leaderboard
from tasks.tracking import configure_tracking, log_reports, log_variant_run, parent_run, write_reports


@dataclass(frozen=True)
class PipelineOutcome:
    leaderboard: Leaderboard
    registration: Registration
    aliases: list[str]
    gate_reason: str


def workdir(config: Config, root: Path) -> Path:
    return root / config.project.workdir


@task(name="load", cache_policy=NO_CACHE)
def load_task(config: Config, root: Path) -> BaseModel:
    return prepare_base_model(config.model, workdir(config, root) / "base")


@task(name="data", cache_policy=NO_CACHE)
def data_task(config: Config, root: Path) -> PreparedData:
    work = workdir(config, root)
    return prepare_data(config.data, root / config.project.downloads, work / "data")


@task(name="optimize", task_run_name="optimize-{name}", cache_policy=NO_CACHE)
def optimize_task(
    name: str, variant: VariantConfig, base: BaseModel, data: PreparedData, out_dir: Path
) -> VariantManifest:
    calibration = read_split(data.folder, "calibration")
    with progress_bar(f"optimize {name}") as update:
        return build_variant(
            name, variant, base, data.content_hash, out_dir, calibration, lambda _, i, n: update(i, n)
        )


@task(name="evaluate", task_run_name="evaluate-{folder.name}", cache_policy=NO_CACHE)
def evaluate_task(
    folder: Path,
    manifest: VariantManifest,
    texts: list[str],
    config: Config,
    reference: list[list[int]] | None,
    cache: Path,
) -> VariantEvaluation:
    """Evaluate through the Runtime, or reuse the saved result for the same bytes, text, settings and code."""
    key = evaluation_key(manifest.content_hash, texts, config.evaluate, reference)
    saved = load_evaluation(cache / f"{folder.name}.json", key)
    if saved is not None:
        get_run_logger().info(f"{folder.name}: evaluation unchanged since the last run, reused")
        return saved
    runtime = load_runtime(folder, config.target.threads)
    with progress_bar(f"perplexity {folder.name}") as update:
        evaluation = evaluate_variant(runtime, texts, config.evaluate, reference, update)
    save_evaluation(cache / f"{folder.name}.json", key, evaluation)
    return evaluation


@task(name="benchmark", task_run_name="benchmark-{folder.name}", cache_policy=NO_CACHE)
def benchmark_task(folder: Path, config: Config, prompt_text: str) -> BenchmarkResult:
    return benchmark_in_fresh_process(folder, config.benchmark, prompt_text, config.target.threads)


@task(name="register", cache_policy=NO_CACHE)
def register_task(
    config: Config, folder: Path, manifest: VariantManifest, run_id: str, tags: dict, note: str
) -> Registration:
    return register_variant(config.project.name, folder, manifest, run_id, tags, note)


def prepare_flow_inputs(config: Config, root: Path) -> tuple[BaseModel, PreparedData]:
    return load_task(config, root), data_task(config, root)


@flow(name="llmopt-prepare")
def prepare_flow(config: Config, root: Path) -> tuple[BaseModel, PreparedData]:
    """Materialize the base model and the validated corpus splits (the DVC `prepare` stage)."""
    return prepare_flow_inputs(config, root)


@flow(name="llmopt-pipeline")
def pipeline_flow(config: Config, root: Path) -> PipelineOutcome:
    """Build, measure and rank every variant, then register and promote the winner."""
    logger = get_run_logger()
    base, data = prepare_flow_inputs(config, root)
    texts = read_split(data.folder, "evaluation")
    fingerprint = machine_fingerprint(config.target.threads)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash}
    with parent_run(experiment_id, config, lineage, fingerprint) as parent_id:
        bandwidth = memory_read_bandwidth_gbs(config.target.threads)  # once the services have settled
        logger.info(f"memory read bandwidth {bandwidth:.1f} GB/s (the roofline for decode speed)")
        scores, manifests, runs, reference = [], {}, {}, None
        evaluations = workdir(config, root) / "evaluations"
        for name, variant in baseline_first(config):
            folder = workdir(config, root) / "variants" / name
            manifest = optimize_task(name, variant, base, data, folder)
            evaluation = evaluate_task(folder, manifest, texts, config, reference, evaluations)
            reference = reference or evaluation.continuations
            bench = benchmark_task(folder, config, texts[0])
            runs[name] = log_variant_run(experiment_id, parent_id, variant, manifest, evaluation, bench)
            manifests[name] = manifest
            scores.append(variant_score(name, manifest, evaluation, bench, bandwidth))
            logger.info(f"{name}: ppl {evaluation.perplexity.perplexity:.2f}, {bench.decode_tok_s:.1f} tok/s")
        validate_metrics_table([asdict(score) for score in scores], list(config.variants))
        board = build_leaderboard(scores, config.select)
        reports = write_reports(board, workdir(config, root) / "reports")
        log_reports(parent_id, board, reports, runs, {"memory_read_bandwidth_gbs": bandwidth})
        verdict = gate_verdict(board)
        tags = {
            "llmopt.fingerprint": str(fingerprint["hash"]),
            "llmopt.git_commit": str(fingerprint["git_commit"]),
        }
        winner_dir = workdir(config, root) / "variants" / board.winner
        registration = register_task(
            config, winner_dir, manifests[board.winner], runs[board.winner], tags, board.winner_summary()
        )
        aliases = promote(registration, verdict)
    return PipelineOutcome(board, registration, aliases, verdict.reason)


def baseline_first(config: Config) -> list[tuple[str, VariantConfig]]:
    """The baseline runs first: its greedy continuations are the reference for everyone's agreement."""
    base = config.select.baseline
    return [(base, config.variants[base])] + [(n, v) for n, v in config.variants.items() if n != base]


def variant_score(
    name: str,
    manifest: VariantManifest,
    evaluation: VariantEvaluation,
    bench: BenchmarkResult,
    bandwidth_gbs: float,
) -> VariantScore:
    return VariantScore(
        variant=name,
        perplexity=evaluation.perplexity.perplexity,
        token_agreement=evaluation.agreement.token_agreement,
        cloze_accuracy=evaluation.cloze.accuracy,
        cloze_correct=tuple(evaluation.cloze.correct),
        decode_tok_s=bench.decode_tok_s,
        ttft_ms=bench.ttft_ms,
        size_bytes=manifest.size_bytes,
        peak_rss_mb=bench.peak_rss_mb,
        parameters=manifest.parameters,
        window_nll=tuple(evaluation.perplexity.window_nll),
        window_tokens=tuple(evaluation.perplexity.window_tokens),
        batch_decode_tok_s=tuple((b.batch_size, b.decode_tok_s) for b in bench.batches),
        ttft_ms_by_prompt=tuple(sorted(bench.ttft_ms_by_prompt.items())),
        latency_p95_ms=bench.latency_ms["p95"],
        roofline_fraction=roofline_fraction(bench.decode_tok_s, bench.decode_read_bytes, bandwidth_gbs),
    )

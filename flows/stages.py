"""Prefect tasks around the stage functions, and the two pieces every flow shares: the measuring loop (build,
evaluate, benchmark every variant) and the rank-and-report tail (validate, rank, write, log)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.progress import progress_bar
from tasks.build.optimize import build_variant
from tasks.config import Config, VariantConfig
from tasks.decide.registry import RegisteredVersion, fetch_version
from tasks.decide.select import Leaderboard, build_leaderboard, variant_score
from tasks.engines.manifest import VariantManifest, read_manifest, same_tokenizer
from tasks.errors import LlmoptError
from tasks.expectations import validate_metrics_table
from tasks.inputs.data import PreparedData, prepare_data, read_split
from tasks.inputs.load import PreparedBase, prepare_base_model
from tasks.measure.benchmark import (
    BenchmarkResult,
    benchmark_in_fresh_process,
    median_trial,
    memory_read_bandwidth_gbs,
)
from tasks.measure.evaluate import VariantEvaluation, evaluate_or_reuse
from tasks.report.timings import StageClock
from tasks.report.tracking import log_reports, log_variant_run, write_reports


def workdir(config: Config, root: Path) -> Path:
    return root / config.project.workdir


@task(name="load", cache_policy=NO_CACHE)
def load_task(config: Config, root: Path) -> PreparedBase:
    return prepare_base_model(config.model, workdir(config, root) / "base")


@task(name="data", cache_policy=NO_CACHE)
def data_task(config: Config, root: Path) -> PreparedData:
    return prepare_data(config.data, root / config.project.downloads, workdir(config, root) / "data")


def prepare_inputs(config: Config, root: Path) -> tuple[PreparedBase, PreparedData]:
    return load_task(config, root), data_task(config, root)


@task(name="optimize", task_run_name="optimize-{name}", cache_policy=NO_CACHE)
def optimize_task(
    name: str, variant: VariantConfig, base: PreparedBase, data: PreparedData, out_dir: Path
) -> VariantManifest:
    calibration = read_split(data.folder, "calibration")
    with progress_bar(f"optimize {name}") as update:
        return build_variant(
            name, variant, base, data.content_hash, out_dir, calibration, lambda _, i, n: update(i, n)
        )


@task(name="evaluate", task_run_name="evaluate-{saved.stem}", cache_policy=NO_CACHE)
def evaluate_task(
    folder: Path,
    manifest: VariantManifest,
    texts: list[str],
    config: Config,
    reference: list[list[int]] | None,
    saved: Path,
) -> VariantEvaluation:
    with progress_bar(f"perplexity {saved.stem}") as update:
        evaluation, reused = evaluate_or_reuse(
            folder, manifest, texts, config.evaluate, reference, saved, config.target.threads, update
        )
    if reused:
        get_run_logger().info(f"{saved.stem}: evaluation unchanged since the last run, reused")
    return evaluation


@task(name="benchmark", task_run_name="benchmark-{name}", cache_policy=NO_CACHE)
def benchmark_task(name: str, folder: Path, config: Config, prompt_text: str) -> BenchmarkResult:
    return benchmark_in_fresh_process(folder, config.benchmark, prompt_text, config.target.threads)


def transient_failure(task, task_run, state) -> bool:
    """Retry condition for registry and artifact I/O: a network, database or disk hiccup is retried (with
    backoff); a clear user error (LlmoptError: no such version, corrupted bytes) or a bug is not."""
    import httpx
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import OperationalError

    try:
        state.result()
    except LlmoptError:
        return False
    except (OSError, MlflowException, OperationalError, httpx.TransportError):
        return True
    except Exception:
        return False
    return False


IO_RETRIES = {  # 3 more tries, 2 s, 4 s, 8 s apart
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=2),
    "retry_condition_fn": transient_failure,
}


@task(name="fetch-production", cache_policy=NO_CACHE, **IO_RETRIES)
def fetch_version_task(config: Config, version: RegisteredVersion, dest: Path) -> Path:
    """The registered version's variant folder, downloaded into `dest` (reused while its bytes are intact)."""
    return fetch_version(config.project.name, version, dest)


@dataclass(frozen=True)
class Measurements:
    """Every model's manifest, evaluation and benchmark trials, measured on one machine in one run."""

    manifests: dict[str, VariantManifest]
    evaluations: dict[str, VariantEvaluation]
    trials: dict[str, list[BenchmarkResult]]
    bandwidth_gbs: float
    folders: dict[str, Path]
    registered: dict[str, str]  # registered model (e.g. "production-v3") → the name it was measured under

    def chosen(self, name: str) -> BenchmarkResult:
        """The trial reported for `name`: the one with the median batch-1 decode speed."""
        return median_trial(self.trials[name])


def measure_variants(
    config: Config,
    root: Path,
    base: PreparedBase,
    data: PreparedData,
    trials: int,
    registered: dict[str, RegisteredVersion] | None = None,
    clock: StageClock | None = None,
) -> Measurements:
    """Build (or reuse) and evaluate (or reuse) every variant, baseline first (its greedy continuations are
    everyone's agreement reference), and the `registered` versions beside them (a variant of this run with the
    same bytes stands for one, else it is downloaded); then benchmark them all `trials` times, trials
    interleaving the models so that a slow spell of the machine hits all of them."""
    logger, clock = get_run_logger(), clock or StageClock()
    texts, work = read_split(data.folder, "evaluation"), workdir(config, root)
    manifests, evaluations, folders, reference = {}, {}, {}, None
    for name, variant in baseline_first(config):
        folders[name] = work / "variants" / name
        with clock.stage("build"):
            manifests[name] = optimize_task(name, variant, base, data, folders[name])
        with clock.stage("evaluate"):
            evaluations[name] = evaluate_task(
                folders[name],
                manifests[name],
                texts,
                config,
                reference,
                work / "evaluations" / f"{name}.json",
            )
        reference = reference or evaluations[name].continuations
    stand_ins = {}
    for label, version in (registered or {}).items():
        same = [name for name, manifest in manifests.items() if manifest.model_hash == version.model_hash]
        stand_ins[label] = same[0] if same else label
        if not same:
            with clock.stage("fetch production"):
                folder = fetch_version_task(config, version, work / "registered" / f"v{version.version}")
            folders[label], manifests[label] = folder, read_manifest(folder)
            saved = work / "evaluations" / f"{label}.json"
            with clock.stage("evaluate"):
                evaluations[label] = evaluate_task(folder, manifests[label], texts, config, reference, saved)
        logger.info(f"{label} is measured as {stand_ins[label]}")
    with clock.stage("benchmark"):
        bandwidth = memory_read_bandwidth_gbs(config.target.threads)  # after the builds: the machine settled
    logger.info(f"memory read bandwidth {bandwidth:.1f} GB/s (the roofline for decode speed)")
    results: dict[str, list[BenchmarkResult]] = {name: [] for name in manifests}
    for trial in range(trials):
        for name in manifests:
            with clock.stage("benchmark"):
                results[name].append(benchmark_task(name, folders[name], config, texts[0]))
            perplexity = evaluations[name].perplexity.perplexity
            logger.info(
                f"trial {trial + 1}/{trials} {name}: ppl {perplexity:.2f}, "
                f"{results[name][-1].decode_tok_s:.1f} tok/s"
            )
    return Measurements(manifests, evaluations, results, bandwidth, folders, stand_ins)


def duel(config: Config, measured: Measurements, names: tuple[str, str], prompt_text: str) -> None:
    """`select.duel_trials` more benchmarks of the two models, back to back, appended to their trials."""
    for trial in range(config.select.duel_trials):
        for name in (
            names if trial % 2 == 0 else names[::-1]
        ):  # neither always runs first (warm caches, turbo)
            measured.trials[name].append(benchmark_task(name, measured.folders[name], config, prompt_text))


def baseline_first(config: Config) -> list[tuple[str, VariantConfig]]:
    base = config.select.baseline
    return [(base, config.variants[base])] + [(n, v) for n, v in config.variants.items() if n != base]


def paired_with_baseline(config: Config, measured: Measurements, name: str) -> bool:
    """Whether a model's evaluation pairs with the baseline's: same tokenizer, so same windows and items."""
    return same_tokenizer(measured.folders[name], measured.folders[config.select.baseline])


def rank_and_report(
    config: Config,
    measured: Measurements,
    out_dir: Path,
    run_ids: tuple[str, str],
    extra_reports: list[Path],
    run_metrics: dict[str, float],
    fingerprint: dict,
) -> tuple[Leaderboard, dict[str, str]]:
    """Validate the metrics table (Great Expectations), rank, write the reports into `out_dir` and log one
    nested MLflow run per ranked model under the parent run; returns the leaderboard and the run ids. A registered
    version on another tokenizer cannot be paired with this run's baseline and is left out of the ranking."""
    experiment_id, parent_id = run_ids
    m = measured
    fetched = set(m.registered.values()) - set(config.variants)
    names = [n for n in m.manifests if n not in fetched or paired_with_baseline(config, m, n)]
    scores = [variant_score(n, m.manifests[n], m.evaluations[n], m.chosen(n), m.bandwidth_gbs) for n in names]
    validate_metrics_table([asdict(score) for score in scores], names)
    board = build_leaderboard(scores, config.select)
    reports = write_reports(board, out_dir) + extra_reports
    fingerprint_hash = str(fingerprint["hash"])  # every model of the run was measured on this machine
    runs = {
        name: log_variant_run(
            experiment_id, parent_id, m.manifests[name], m.evaluations[name], m.chosen(name), fingerprint_hash
        )
        for name in names
    }
    metrics = {"memory_read_bandwidth_gbs": m.bandwidth_gbs, **run_metrics}
    log_reports(parent_id, board, reports, runs, metrics)
    return board, runs

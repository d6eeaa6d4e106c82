"""Prefect tasks around the stage functions, and the two pieces every flow shares: the measuring loop (build,
evaluate, benchmark every variant) and the rank-and-report tail (validate, rank, write, log)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.cluster import (
    BENCHMARK_RESOURCE,
    Stored,
    Workspace,
    on_benchmark_worker,
    on_benchmark_workers,
    workspace,
)
from flows.progress import progress_bar, run_progress
from flows.retries import IO_RETRIES
from tasks.decide.model_registry import RegisteredVersion, fetch_version
from tasks.decide.select import Leaderboard, build_leaderboard, variant_score
from tasks.engines.manifest import VariantManifest, read_manifest, same_tokenizer
from tasks.errors import ArtifactUnreadable
from tasks.expectations import validate_metrics_table
from tasks.inputs.data import PreparedData, prepare_data, read_split
from tasks.inputs.load import PreparedBase, prepare_base_model
from tasks.inputs.long_documents import FILE as LONG_DOCUMENTS
from tasks.inputs.long_documents import check_positions, long_documents, prepare_long_documents, read_prepared
from tasks.measure.benchmark import (
    BenchmarkResult,
    benchmark_in_fresh_process,
    median_trial,
    memory_read_bandwidth_gbs,
)
from tasks.measure.evaluate import VariantEvaluation, evaluate_or_reuse
from tasks.measure.fingerprint import git_commit, machine_fingerprint
from tasks.measure.plan import baseline_first, may_fail_alone, outside_budget, served_here
from tasks.measure.served import ServedPlan, served_metrics, served_plan
from tasks.params import Config, VariantConfig
from tasks.report.leaderboard_files import write_reports
from tasks.report.timeline import Span, check_benchmarks_clean, timed
from tasks.report.timings import StageClock
from tasks.report.tracking import ParentRun, log_failed_variant_run, log_reports, log_variant_run
from tasks.techniques.build import build_order, build_variant


def workdir(config: Config, root: Path) -> Path:
    return root / config.project.workdir


@task(name="load", cache_policy=NO_CACHE)
def load_task(config: Config, root: Path) -> PreparedBase:
    return prepare_base_model(config.model, workdir(config, root) / "base")


@task(name="data", cache_policy=NO_CACHE)
def data_task(config: Config, root: Path) -> PreparedData:
    """The corpus splits and, with `long_context` set, the long documents beside them."""
    downloads, folder = root / config.project.downloads, workdir(config, root) / "data"
    data = prepare_data(config.data, downloads, folder)
    if config.long_context:
        prepare_long_documents(config.long_context, downloads, folder)
    else:
        for stale in (folder / LONG_DOCUMENTS, folder / (LONG_DOCUMENTS + ".key")):
            stale.unlink(missing_ok=True)
    return data


def prepare_inputs(config: Config, root: Path) -> tuple[PreparedBase, PreparedData]:
    base = load_task(config, root)
    if config.long_context:  # before anything is built: the longest windows must fit the model
        check_positions("long_context.lengths", config.long_context.longest, base.path)
    for setting in ("long_prompt_tokens", "served_lengths"):
        if lengths := getattr(config.benchmark, setting):
            check_positions(f"benchmark.{setting}", max(lengths), base.path)
    return base, data_task(config, root)


@dataclass(frozen=True)
class Inputs:
    """The prepared base model and data splits, and where workers find them."""

    base: PreparedBase
    base_stored: Stored
    data: PreparedData
    data_stored: Stored


@dataclass(frozen=True)
class Built:
    name: str
    manifest: VariantManifest
    stored: Stored  # the variant folder on the flow's machine, and its key in the shared store
    span: Span | None  # None: not built in this run (a registered version, downloaded)


@dataclass(frozen=True)
class Evaluated:
    evaluation: VariantEvaluation
    span: Span


@task(name="build", task_run_name="build-{name}", cache_policy=NO_CACHE)
def build_task(
    name: str,
    variant: VariantConfig,
    inputs: Inputs,
    space: Workspace,
    draft: tuple[str, VariantConfig] | None = None,
    device: str = "cpu",
) -> Built:
    """`draft`: a `speculative: {method: draft}` recipe's proposer (built into its folder); `device`: the target's."""
    with timed("build", name) as span:
        base = replace(inputs.base, path=space.fetch(inputs.base_stored))
        calibration = read_split(space.fetch(inputs.data_stored), "calibration")
        out_dir = space.local(f"variants/{name}")
        with progress_bar("build", name) as update:
            manifest = build_variant(
                name,
                variant,
                base,
                inputs.data.content_hash,
                out_dir,
                calibration,
                lambda _, i, n: update(i, n),
                statistics=space.local("statistics"),
                draft=draft,
                device=device,
            )
        stored = space.publish(out_dir)
    return Built(name, manifest, replace(stored, path=space.workdir / "variants" / name), span[0])


@task(name="evaluate", task_run_name="evaluate-{built.name}", cache_policy=NO_CACHE)
def evaluate_task(
    built: Built,
    texts: list[str],
    config: Config,
    reference: Evaluated | None,
    space: Workspace,
    documents: list[tuple[str, str]] | None = None,
) -> Evaluated:
    """Evaluate the model (or reuse its saved evaluation); `reference`: the baseline's, for greedy agreement;
    `documents`: the long documents (with `long_context` set)."""
    with timed("evaluate", built.name) as span:
        folder, saved = space.fetch(built.stored), space.local(f"evaluations/{built.name}.json")
        continuations = reference.evaluation.continuations if reference else None
        with progress_bar("evaluate", built.name) as update:
            evaluation, reused = evaluate_or_reuse(
                folder,
                built.manifest,
                texts,
                config.evaluate,
                continuations,
                saved,
                config.target,
                update,
                (config.long_context, long_documents(documents)) if config.long_context else None,
            )
        if reused:
            get_run_logger().info(f"{built.name}: evaluation unchanged since the last run, reused")
    return Evaluated(evaluation, span[0])


@task(name="benchmark", task_run_name="benchmark-{name}", cache_policy=NO_CACHE)
def benchmark_task(
    name: str,
    stored: Stored,
    config: Config,
    prompt_text: str,
    space: Workspace,
    short: bool = False,
    served: ServedPlan | None = None,
) -> tuple[BenchmarkResult, Span]:
    """`short`: the variant is outside the accuracy budget, so it gets `BenchmarkConfig.short` (no served
    capacity). `served`: the served-capacity plan (None: not measured, as for the peer row)."""
    folder = space.fetch(stored)  # before the clock: a download is not part of the measurement
    machine = str(machine_fingerprint(config.target)["hash"])
    settings = config.benchmark.short() if short else config.benchmark
    with timed("benchmark", name, machine) as span, progress_bar("benchmark", name):
        result = benchmark_in_fresh_process(folder, settings, prompt_text, config.target, served)
    return replace(result, short=short), span[0]


@task(name="fingerprint", cache_policy=NO_CACHE)
def fingerprint_task(config: Config) -> dict:
    return machine_fingerprint(config.target)


@task(name="bandwidth", cache_policy=NO_CACHE)
def bandwidth_task(config: Config) -> tuple[float, Span]:
    """The benchmark machine's memory read bandwidth (the roofline for decode speed)."""
    machine = str(machine_fingerprint(config.target)["hash"])
    with timed("bandwidth", "memory", machine) as span:
        bandwidth = memory_read_bandwidth_gbs(config.target)
    return bandwidth, span[0]


def benchmark_fingerprint(config: Config) -> dict:
    """The fingerprint of the machine benchmarks run on (this one, or a benchmark worker of the cluster), with
    this checkout's git commit (a worker's working folder may be anywhere)."""
    with on_benchmark_workers(config):
        fingerprint = on_benchmark_worker(fingerprint_task.submit(config))
    return {**fingerprint, "git_commit": git_commit(Path.cwd())}


@task(name="fetch-production", cache_policy=NO_CACHE, **IO_RETRIES)
def fetch_version_task(config: Config, version: RegisteredVersion, dest: Path) -> Path:
    """The registered version's variant folder, downloaded into `dest` (reused while its bytes are intact)."""
    return fetch_version(config.project.name, version, dest)


@dataclass(frozen=True)
class FailedVariant:
    """A variant of the run whose artifact its engine refused (a GGUF or ONNX file that parses wrong though its
    bytes match their hash): left out of the ranking, the run goes on with the others."""

    manifest: VariantManifest
    stage: str  # where it failed: evaluate or benchmark
    message: str  # the file and the engine's own words


# what a variant's weights file that its engine cannot parse raises; anything else (a hash mismatch, a missing
# package, a full disk, a bug) stops the run as before
ENGINE_REFUSALS = (ArtifactUnreadable,)


def fail_alone(
    config: Config,
    name: str,
    stand_ins: dict[str, str],
    manifest: VariantManifest,
    stage: str,
    exc: ArtifactUnreadable,
) -> FailedVariant:
    """`name` failed and the run goes on without it (a warning line says so) where `may_fail_alone`; else `exc`
    stops the run."""
    if not may_fail_alone(config, name, stand_ins):
        raise exc
    get_run_logger().warning(f"{name} failed and is left out of this run: {exc}")
    return FailedVariant(manifest, stage, str(exc))


@dataclass(frozen=True)
class Measurements:
    """Every model's manifest, evaluation and benchmark trials, measured on one machine in one run."""

    manifests: dict[str, VariantManifest]
    evaluations: dict[str, VariantEvaluation]
    trials: dict[str, list[BenchmarkResult]]
    bandwidth_gbs: float
    folders: dict[str, Stored]  # on the flow's machine, and in the shared store
    registered: dict[
        str, str
    ]  # registered version (its `version_label`, e.g. "production-v3") → the name it was measured under
    fingerprint: dict  # of the machine every benchmark ran on
    spans: list[Span]  # every task of the run: what ran where, when
    space: Workspace  # where the folders' bytes are
    served: ServedPlan | None = None  # the served-capacity plan every selectable model was measured with
    failed: dict[str, FailedVariant] = field(default_factory=dict)  # built, but its engine could not run it

    def chosen(self, name: str) -> BenchmarkResult:
        """The trial reported for `name`: the one with the median batch-1 decode speed (with the served capacity by
        length of the trial that measured it: the duel's trials do not)."""
        trial, trials = median_trial(self.trials[name]), self.trials[name]
        by_length = next((t.served_by_length for t in trials if t.served_by_length), trial.served_by_length)
        return replace(trial, served_by_length=by_length)


def measure_variants(
    config: Config,
    root: Path,
    base: PreparedBase,
    data: PreparedData,
    trials: int,
    fingerprint: dict,
    registered: dict[str, RegisteredVersion] | None = None,
    clock: StageClock | None = None,
) -> Measurements:
    """Build (or reuse) and evaluate (or reuse) every variant and the `registered` versions beside them (a variant
    of this run with the same bytes stands for one, else it is downloaded): all at once on a Dask cluster, one
    after another here; the baseline's greedy continuations are everyone's agreement reference. Then, with
    nothing else running, benchmark them all `trials` times, one at a time on the benchmark machine, trials
    interleaving the models so that a slow spell of the machine hits all of them. `fingerprint`: the benchmark
    machine's (`benchmark_fingerprint`); a benchmark that ran on another kind of machine fails the run."""
    logger, clock, space = get_run_logger(), clock or StageClock(), workspace(config, root)
    texts = read_split(data.folder, "evaluation")
    documents = read_prepared(data.folder) if config.long_context else []
    inputs = Inputs(base, space.publish(base.path), data, space.publish(data.folder))
    order = [name for name, _ in baseline_first(config)]
    with run_progress({"build": len(order), "evaluate": len(order), "benchmark": 0}) as display:
        builds: dict[str, Any] = {}
        for name, waits_for in build_order(config.variants, order):
            variant = config.variants[name]
            draft_name = variant.runtime.speculative.draft if variant.runtime.speculative else None
            draft = (draft_name, config.variants[draft_name]) if draft_name else None
            before = [builds[other] for other in waits_for]
            device = config.target.device  # where calibration runs (a GPU's when the worker has it)
            builds[name] = build_task.submit(name, variant, inputs, space, draft, device, wait_for=before)
        evaluations = {}
        for name in order:
            reference = evaluations.get(order[0])  # a future: each evaluation waits for the baseline's
            evaluations[name] = evaluate_task.submit(builds[name], texts, config, reference, space, documents)
        stand_ins, fetched = {}, {}
        for label, version in (registered or {}).items():
            same = [n for n in order if builds[n].result().manifest.model_hash == version.model_hash]
            stand_ins[label] = same[0] if same else label
            if not same:
                with clock.stage("fetch production"):
                    folder = fetch_version_task(
                        config, version, space.workdir / "registered" / f"v{version.version}"
                    )
                fetched[label] = Built(label, read_manifest(folder), space.publish(folder), None)
                evaluations[label] = evaluate_task.submit(
                    fetched[label], texts, config, evaluations[order[0]], space, documents
                )
            logger.info(f"{label} is measured as {stand_ins[label]}")
        built = {name: builds[name].result() for name in order} | fetched  # the barrier: nothing runs ...
        done, failed = {}, {}
        for name, future in evaluations.items():
            try:
                done[name] = future.result()
            except ENGINE_REFUSALS as exc:
                failed[name] = fail_alone(config, name, stand_ins, built[name].manifest, "evaluate", exc)
        spans = [b.span for b in built.values() if b.span] + [e.span for e in done.values()]
        manifests = {name: b.manifest for name, b in built.items() if name not in failed}
        folders = {name: b.stored for name, b in built.items() if name not in failed}
        evaluated = {name: e.evaluation for name, e in done.items()}
        short = outside_budget(config, manifests, evaluated, exclude=set(stand_ins.values()))
        if short:
            logger.info(
                f"outside the accuracy budget, so a short benchmark (never selected): {', '.join(short)}"
            )
        plan = served_plan(config, data.folder)
        served = {name: plan if served_here(config, name, m) else None for name, m in manifests.items()}
        display.expect("evaluate", len(done))
        display.expect("benchmark", len(manifests) * trials)
        with on_benchmark_workers(config):  # ... beside the benchmarks, which run one at a time
            bandwidth, span = on_benchmark_worker(bandwidth_task.submit(config))
            spans.append(span)
            logger.info(f"memory read bandwidth {bandwidth:.1f} GB/s (the roofline for decode speed)")
            results: dict[str, list[BenchmarkResult]] = {name: [] for name in manifests}
            for trial in range(trials):
                for name in [n for n in manifests if n not in failed]:
                    try:
                        result, span = on_benchmark_worker(
                            benchmark_task.submit(
                                name, folders[name], config, texts[0], space, name in short, served[name]
                            )
                        )
                    except ENGINE_REFUSALS as exc:
                        failed[name] = fail_alone(config, name, stand_ins, manifests[name], "benchmark", exc)
                        continue
                    results[name].append(result)
                    spans.append(span)
                    perplexity = done[name].evaluation.perplexity.perplexity
                    logger.info(
                        f"trial {trial + 1}/{trials} {name}: ppl {perplexity:.2f}, {result.decode_tok_s:.1f} tok/s"
                    )
    check_benchmarks_clean(str(fingerprint["hash"]), spans, BENCHMARK_RESOURCE)
    for span in spans:
        clock.add(span.kind if span.kind != "bandwidth" else "benchmark", span.seconds)
    evaluated = {name: e.evaluation for name, e in done.items() if name not in failed}
    kept = [name for name in manifests if name not in failed]
    return Measurements(
        {name: manifests[name] for name in kept},
        evaluated,
        {name: results[name] for name in kept},
        bandwidth,
        {name: folders[name] for name in kept},
        stand_ins,
        fingerprint,
        spans,
        space,
        plan,
        failed,
    )


def duel(config: Config, measured: Measurements, names: tuple[str, str], prompt_text: str) -> None:
    """`select.duel_trials` more benchmarks of the two models, back to back, appended to their trials."""
    with on_benchmark_workers(config):
        for trial in range(config.select.duel_trials):
            for name in names if trial % 2 == 0 else names[::-1]:  # neither always first (warm caches, turbo)
                args = (
                    name,
                    measured.folders[name],
                    config,
                    prompt_text,
                    measured.space,
                    False,
                    replace(measured.served, lengths=())  # what the duel compares: the served mix
                    if config.select.objective == "serving" and measured.served
                    else None,
                )
                result, span = on_benchmark_worker(benchmark_task.submit(*args))
                measured.trials[name].append(result)
                measured.spans.append(span)
    check_benchmarks_clean(str(measured.fingerprint["hash"]), measured.spans, BENCHMARK_RESOURCE)


def paired_with_baseline(config: Config, measured: Measurements, name: str) -> bool:
    """Whether a model's evaluation pairs with the baseline's: same tokenizer, so same windows and items."""
    baseline = measured.space.bring_home(measured.folders[config.select.baseline])
    return same_tokenizer(measured.folders[name].path, baseline)


def rank_and_report(
    config: Config,
    measured: Measurements,
    out_dir: Path,
    *,
    run: ParentRun,
    extra_reports: tuple[Path, ...] = (),
    run_metrics: dict[str, float] | None = None,
) -> tuple[Leaderboard, dict[str, str]]:
    """Validate the metrics table (Great Expectations), rank, write the reports into `out_dir` and log one
    nested MLflow run per ranked model under the parent run; returns the leaderboard and the run ids. A registered
    version on another tokenizer cannot be paired with this run's baseline and is left out of the ranking.
    `extra_reports` are logged beside the leaderboard's files, `run_metrics` on the parent run."""
    m = measured
    fetched = set(m.registered.values()) - set(config.variants)
    names = [n for n in m.manifests if n not in fetched or paired_with_baseline(config, m, n)]
    scores = [variant_score(n, m.manifests[n], m.evaluations[n], m.chosen(n), m.bandwidth_gbs) for n in names]
    validate_metrics_table([asdict(score) | served_metrics(score.served) for score in scores], names)
    failed = {name: f"{f.message} (in {f.stage})" for name, f in m.failed.items()}
    board = replace(build_leaderboard(scores, config.select), failed=failed)
    reports = write_reports(board, out_dir) + list(extra_reports)
    fingerprint_hash = str(m.fingerprint["hash"])  # every model of the run was measured on this machine
    runs = {
        name: log_variant_run(
            run.experiment_id,
            run.run_id,
            m.manifests[name],
            m.evaluations[name],
            m.chosen(name),
            fingerprint_hash,
        )
        for name in names
    }
    for failure in m.failed.values():
        log_failed_variant_run(
            run.experiment_id, run.run_id, failure.manifest, failure.stage, failure.message
        )
    metrics = {"memory_read_bandwidth_gbs": m.bandwidth_gbs, **(run_metrics or {})}
    log_reports(run.run_id, board, reports, runs, metrics)
    return board, runs

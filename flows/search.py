"""The search flow (`llmopt search`): build params.yaml's variants and the space's candidates, take every one's
proxies, race the screened ones against the leader, confirm the winner, and leave the record: one MLflow parent
run with a nested run per trial, `.llmopt/search/trials.json` and the winner's `variants:` block. The stage logic
is tasks/search/; this module wires it to the prepared inputs, the builds and MLflow."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.progress import progress_bar
from flows.stages import benchmark_fingerprint, prepare_inputs, workdir
from tasks.engines.manifest import VariantManifest
from tasks.inputs.data import read_split
from tasks.inputs.load import PreparedBase
from tasks.params import Config, VariantConfig
from tasks.project_lock import project_lock
from tasks.report.search_plot import search_plot
from tasks.report.tracking import (
    configure_tracking,
    log_nested_run,
    log_run_report,
    parent_run,
    recipe_params,
)
from tasks.search.course import (
    choose_leader,
    proposals,
    race_plan,
    split_windows,
    trial_records,
    winner_block,
    write_record,
)
from tasks.search.driver import SearchOutcome, run_search
from tasks.search.isolated import IsolatedRuntime
from tasks.search.journal import Journal, journal_key
from tasks.search.measure import EngineMeasurer
from tasks.techniques.build import build_variant


@dataclass(frozen=True)
class SearchReport:
    outcome: SearchOutcome
    leader: str
    notes: list[str]
    files: list[Path]
    winner_block: str | None

    def summary(self) -> str:
        counts = ", ".join(f"{count} {stage}" for stage, count in self.outcome.counts().items())
        if self.outcome.winner is None:
            return f"search: {counts}; no candidate beat {self.leader} with confidence"
        speed, _ = self.outcome.confirmation
        return (
            f"search: {counts}; {self.outcome.winner} runs ×{speed.ratio:.3f} {self.leader} "
            f"({speed.low:.3f}–{speed.high:.3f} at {speed.confidence:.1%}, confirmed on fresh pairs)"
        )


@task(name="build", task_run_name="build-{name}", cache_policy=NO_CACHE)
def search_build_task(
    name: str, variant: VariantConfig, base: PreparedBase, data_hash: str, root: Path, calibration: list[str]
) -> VariantManifest:
    """One build into `.llmopt/search/variants/<name>`; bytes a run's variant already holds are linked."""
    with progress_bar("build", name) as update:
        return build_variant(
            name,
            variant,
            base,
            data_hash,
            root / "search" / "variants" / name,
            calibration,
            lambda _, i, n: update(i, n),
            statistics=root / "statistics",
            siblings=root / "variants",
        )


@flow(name="llmopt-search", task_runner=ThreadPoolTaskRunner(max_workers=1))
def search_flow(config: Config, root: Path) -> SearchReport:
    with project_lock(workdir(config, root), "search", get_run_logger().warning):
        return _search(config, root)


def _search(config: Config, root: Path) -> SearchReport:
    logger, started, work = get_run_logger(), time.monotonic(), workdir(config, root)
    base, data = prepare_inputs(config, root)
    defaults, candidates, notes = proposals(config)
    calibration, evaluation = read_split(data.folder, "calibration"), read_split(data.folder, "evaluation")
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash}
    fingerprint = benchmark_fingerprint(config)
    with parent_run(experiment_id, config, lineage, fingerprint, kind="search") as run:
        baseline = config.select.baseline
        order = {
            baseline: config.variants[baseline],
            **defaults,
            **{n: c.variant for n, c in candidates.items()},
        }
        manifests = {}
        for name, variant in order.items():
            budget = config.search.budget_minutes
            if budget and name in candidates and time.monotonic() - started > 60 * budget:
                notes.append(f"{name}: not built, search.budget_minutes reached")
                continue
            manifests[name] = search_build_task(name, variant, base, data.content_hash, work, calibration)
        folders = {name: work / "search" / "variants" / name for name in manifests}
        reference = IsolatedRuntime(folders[baseline], config.target)  # engines apart: see isolated.py
        try:
            windows = split_windows(reference.encode, calibration, evaluation, config)
            prompt = reference.encode(evaluation[0])[: config.benchmark.prompt_tokens]
        except BaseException:
            reference.close()
            raise
        journal = search_journal(work, config, windows, prompt, fingerprint)
        if journal.resumed:
            logger.info(f"resuming an interrupted search: {journal.summary()} kept by its journal")
        sizes = {name: manifest.size_bytes for name, manifest in manifests.items()}
        measurer = EngineMeasurer(
            lambda name: IsolatedRuntime(folders[name], config.target),
            sizes,
            windows,
            prompt,
            config.search.decode_tokens,
            baseline,
            keep_loaded(manifests),
            {baseline: reference},
            journal,
            {name: f"{base.content_hash}:{manifest.model_hash}" for name, manifest in manifests.items()},
        )
        try:
            report = _race(config, measurer, manifests, defaults, candidates, notes, work)
        finally:
            measurer.close()
        journal.finish()
        for name, trial in report.outcome.trials.items():
            _log_trial(experiment_id, run.run_id, manifests[name], trial, report.leader)
        counts = {f"search.{k}": float(v) for k, v in report.outcome.counts().items()}
        log_run_report(run.run_id, report.files, counts)
    return report


def _race(
    config: Config,
    measurer: EngineMeasurer,
    manifests: dict[str, VariantManifest],
    defaults: dict[str, VariantConfig],
    candidates: dict,
    notes: list[str],
    work: Path,
) -> SearchReport:
    """The leader, the race, the record (trials.json, winner.yaml, search.png)."""
    plan = race_plan(config)
    kl_limit = plan.kl_margin * math.log1p(plan.max_ppl_increase)
    default_proxies = {name: measurer.proxy(name) for name in defaults}
    leader = choose_leader(config, default_proxies, kl_limit)
    racing = [name for name in manifests if name not in (config.select.baseline, leader)]
    get_run_logger().info(f"leader: {leader}; racing {len(racing)} candidates")
    outcome = run_search(racing, leader, measurer, plan, get_run_logger().info)
    recipes = {name: manifest.recipe for name, manifest in manifests.items()}
    block = winner_block(outcome, candidates)
    files = write_record(work / "search", outcome, recipes, block)
    mark = default_proxies.get(leader)
    mark = (leader, mark.kl, mark.decode_tok_s) if mark else None
    records = trial_records(outcome, recipes)
    files.append(search_plot(records, mark, kl_limit, work / "search" / "search.png"))
    return SearchReport(outcome, leader, notes, files, block)


def search_journal(work: Path, config: Config, windows: dict, prompt: list[int], machine: dict) -> Journal:
    """The search's journal (tasks/search/journal.py), keyed by what its measurements depend on beside the bytes."""
    parts = {
        "search": config.search.model_dump(mode="json"),
        "select": config.select.model_dump(mode="json"),
        "windows": windows,
        "prompt": prompt,
        "machine": machine["hash"],
    }
    return Journal(work / "search" / "journal.json", journal_key(parts))


def keep_loaded(manifests: dict[str, VariantManifest]) -> int:
    """How many variants' processes stay loaded: all of them where memory allows (a round walks every candidate,
    the baseline and the leader: fewer means loading again every round), at least 3. Each process is counted as its
    largest variant's bytes twice (weights and working memory) plus 0.5 GB (an interpreter with its libraries)."""
    from tasks.engines.contract import free_memory

    each = 2 * max((m.size_bytes for m in manifests.values()), default=0) + 500 * 2**20
    return max(3, min(len(manifests), free_memory() // each))


def _log_trial(experiment_id: str, parent: str, manifest: VariantManifest, trial, leader: str) -> None:
    last = trial.looks[-1] if trial.looks else None
    metrics = {}
    if trial.proxy is not None:
        metrics |= {"proxy.kl": trial.proxy.kl, "proxy.decode_tok_s": trial.proxy.decode_tok_s}
        metrics["size_mb"] = trial.proxy.stored_bytes / 1e6
    if last is not None and last.speed is not None:
        metrics |= {"race.speed_ratio": last.speed.ratio, "race.speed_low": last.speed.low}
        metrics["race.speed_high"] = last.speed.high if math.isfinite(last.speed.high) else float("nan")
    if last is not None and last.accuracy is not None:
        metrics |= {"race.ppl_ratio": last.accuracy.ratio, "race.ppl_ratio_high": last.accuracy.high}
    tags = {"llmopt.kind": "search-trial", "llmopt.variant": trial.name, "llmopt.search_stage": trial.stage}
    tags |= {"llmopt.search_reason": trial.reason[:5000], "llmopt.search_leader": leader}
    params = {**recipe_params(manifest), "rounds": len(trial.looks), "pairs": len(trial.speeds[0])}
    log_nested_run(experiment_id, parent, trial.name, tags, params, metrics)

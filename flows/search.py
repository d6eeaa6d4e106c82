"""The search flow (`llmopt search`): build params.yaml's variants and the space's candidates, take every one's
proxies, race the screened ones against the leader, confirm the winner, and leave the record: one MLflow parent
run with a nested run per trial, `.llmopt/search/trials.json` and the winner's `variants:` block. The stage logic
is tasks/search/; this module wires it to the prepared inputs, the builds and MLflow."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.progress import clock, progress_bar
from flows.stages import benchmark_fingerprint, prepare_inputs, workdir
from tasks.decide.model_registry import Registration
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
    candidate_room,
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
from tasks.search.proxies import Proxy
from tasks.search.sampler import choose_sampler, explore
from tasks.search.space import Candidate
from tasks.techniques.build import build_variant


@dataclass(frozen=True)
class SearchReport:
    outcome: SearchOutcome
    leader: str
    notes: list[str]
    files: list[Path]
    winner_block: str | None
    registration: Registration | None = (
        None  # the confirmed winner, registered for the gate (`search.promote`)
    )

    def summary(self) -> str:
        counts = ", ".join(f"{count} {stage}" for stage, count in self.outcome.counts().items())
        if self.outcome.winner is None:
            return f"search: {counts}; no candidate beat {self.leader} with confidence"
        speed, _ = self.outcome.confirmation
        return (
            f"search: {counts}; {self.outcome.winner} runs ×{speed.ratio:.3f} {self.leader} "
            f"({speed.low:.3f}–{speed.high:.3f} at {speed.confidence:.1%}, confirmed on fresh pairs)"
        )


@dataclass
class Builds:
    """The search's built variants, and what the measurer reads of them (folders, bytes, the identities its journal
    keeps measurements under), growing as the sampler's candidates are built."""

    work: Path
    base_hash: str
    manifests: dict[str, VariantManifest] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    identities: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, manifest: VariantManifest) -> None:
        self.manifests[name], self.sizes[name] = manifest, manifest.size_bytes
        self.folders[name] = self.work / "search" / "variants" / name
        self.identities[name] = f"{self.base_hash}:{manifest.model_hash}"


@task(name="build", task_run_name="build-{name}", cache_policy=NO_CACHE)
def search_build_task(
    name: str,
    variant: VariantConfig,
    base: PreparedBase,
    data_hash: str,
    root: Path,
    calibration: list[str],
    device: str = "cpu",
) -> VariantManifest:
    """One build into `.llmopt/search/variants/<name>`; bytes a run's variant already holds are linked;
    calibration on the target's `device`."""
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
            device=device,
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
    build_one = partial(
        search_build_task,
        base=base,
        data_hash=data.content_hash,
        root=work,
        calibration=calibration,
        device=config.target.device,
    )
    with parent_run(experiment_id, config, lineage, fingerprint, kind="search") as run:
        baseline, builds = config.select.baseline, Builds(work, base.content_hash)
        for name, variant in {baseline: config.variants[baseline], **defaults}.items():
            builds.add(name, build_one(name, variant))
        reference = IsolatedRuntime(builds.folders[baseline], config.target)  # engines apart: see isolated.py
        try:
            windows = split_windows(reference.encode, calibration, evaluation, config)
            prompt = reference.encode(evaluation[0])[: config.benchmark.prompt_tokens]
        except BaseException:
            reference.close()
            raise
        journal = search_journal(work, config, windows, prompt, fingerprint)
        if journal.resumed:
            logger.info(f"resuming an interrupted search: {journal.summary()} kept by its journal")
        measurer = EngineMeasurer(
            lambda name: IsolatedRuntime(builds.folders[name], config.target),
            builds.sizes,  # grows with the sampler's builds, as do the folders and identities
            windows,
            prompt,
            config.search.decode_tokens,
            baseline,
            keep_loaded(builds.manifests, len(builds.manifests) + candidate_room(config, len(defaults))),
            {baseline: reference},
            journal,
            builds.identities,
        )

        def build(candidate: Candidate) -> bool:
            try:
                built = build_one(candidate.name, candidate.variant)
            except Exception as exc:  # one candidate's failure is its record, not the search's end
                notes.append(f"{candidate.name}: not built: {str(exc).splitlines()[0][:300]}")
                return False
            builds.add(candidate.name, built)
            return True

        try:
            explored = _explore(config, candidates, len(defaults), build, measurer, started, notes)
            report = _race(config, measurer, builds.manifests, defaults, explored, notes, work)
        finally:
            measurer.close()
        journal.finish()
        return _record(config, experiment_id, run.run_id, builds, report)


def _record(
    config: Config, experiment_id: str, parent: str, builds: Builds, report: SearchReport
) -> SearchReport:
    """A nested MLflow run per trial, the record on the search's run; the winner registered for the gate."""
    trial_runs = {
        name: _log_trial(experiment_id, parent, builds.manifests[name], trial, report.leader)
        for name, trial in report.outcome.trials.items()
    }
    counts = {f"search.{k}": float(v) for k, v in report.outcome.counts().items()}
    log_run_report(parent, report.files, counts)
    if not (report.winner_block and config.search.promote):
        return report
    winner = report.outcome.winner
    found = (builds.folders[winner], builds.manifests[winner], trial_runs[winner])
    return replace(report, registration=register_found(config, *found, report.leader, report.summary()))


def register_found(
    config: Config, folder: Path, manifest: VariantManifest, run_id: str, leader: str, summary: str
) -> Registration:
    """The search's confirmed winner registered from its trial's run (identical bytes reuse their version) and
    aliased `candidate`, as a run registers its winner; the gate (`llmopt promote`'s) then decides production."""
    from tasks.decide.model_registry import register_variant, set_candidate

    tags = {"llmopt.source": "search", "llmopt.search_leader": leader}
    registration = register_variant(config.project.name, folder, manifest, run_id, tags, summary)
    set_candidate(registration)
    return registration


def _explore(
    config: Config,
    candidates: dict[str, Candidate],
    defaults: int,
    build: Callable[[Candidate], bool],
    measurer: EngineMeasurer,
    started: float,
    notes: list[str],
) -> dict[str, Candidate]:
    """The space's candidates the sampler builds and proxies (tasks/search/sampler.py), within the room and budget."""
    s, space, room = config.search, list(candidates.values()), candidate_room(config, defaults)
    sampler = choose_sampler(s.sampler, len(space), room, s.budget_minutes)
    get_run_logger().info(
        f"proposing from {len(space)} candidates ({sampler} sampler), building {min(room, len(space))} at most"
    )

    def out_of_time() -> bool:
        return s.budget_minutes is not None and time.monotonic() - started > 60 * s.budget_minutes

    tried: list[str] = []

    def counted(candidate: Candidate) -> bool:
        tried.append(candidate.name)
        return build(candidate)

    def proxied(name: str) -> Proxy:  # a line per candidate: the search's progress while it builds
        found, elapsed = measurer.proxy(name), time.monotonic() - started
        seen.append(name)
        left = (
            f", {clock(max(60 * s.budget_minutes - elapsed, 0))} of the build budget left"
            if s.budget_minutes
            else ""
        )
        get_run_logger().info(
            f"[{clock(elapsed)}] {name}: KL {found.kl:.3g}, {found.decode_tok_s:.1f} tok/s "
            f"(proposed {len(tried)}, built {len(seen)} of {min(room, len(space))} at most{left})"
        )
        return found

    seen: list[str] = []
    built = explore(space, sampler, room, counted, proxied, out_of_time, s.seed)
    if left := len(space) - len(tried):
        why = "search.budget_minutes reached" if out_of_time() else "search.max_candidates reached"
        notes.append(f"{left} of the space's candidates not proposed ({sampler} sampler): {why}")
    return {name: candidates[name] for name in built}


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
    production = production_variant(config, {name: manifests[name] for name in defaults})
    leader = choose_leader(config, default_proxies, kl_limit, production)
    racing = [name for name in manifests if name not in (config.select.baseline, leader)]
    why = (
        "production's bytes"
        if leader == production and not config.search.leader
        else "search.leader or proxies"
    )
    get_run_logger().info(f"leader: {leader} ({why}); racing {len(racing)} candidates")
    outcome = run_search(racing, leader, measurer, plan, get_run_logger().info)
    recipes = {name: manifest.recipe for name, manifest in manifests.items()}
    block = winner_block(outcome, candidates)
    files = write_record(work / "search", outcome, recipes, block)
    mark = default_proxies.get(leader)
    mark = (leader, mark.kl, mark.decode_tok_s) if mark else None
    records = trial_records(outcome, recipes)
    files.append(search_plot(records, mark, kl_limit, work / "search" / "search.png"))
    return SearchReport(outcome, leader, notes, files, block)


def production_variant(config: Config, manifests: dict[str, VariantManifest]) -> str | None:
    """The params.yaml variant holding production's bytes (the search's natural leader: what it must beat), if
    one does; None before the first promotion or when production came from elsewhere."""
    from tasks.decide.model_registry import production_version

    production = production_version(config.project.name)
    if production is None or not production.model_hash:
        return None
    return next((n for n, m in manifests.items() if m.model_hash == production.model_hash), None)


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


def keep_loaded(manifests: dict[str, VariantManifest], variants: int) -> int:
    """How many of the search's `variants` keep their processes loaded: all of them where memory allows (a round
    walks every candidate, the baseline and the leader: fewer means loading again every round), at least 3. Each
    process is counted as the largest variant built so far (the baseline's fp32 bytes, larger than any candidate)
    twice (weights and working memory) plus 0.5 GB (an interpreter with its libraries)."""
    from tasks.engines.contract import free_memory

    each = 2 * max((m.size_bytes for m in manifests.values()), default=0) + 500 * 2**20
    return max(3, min(variants, free_memory() // each))


def _log_trial(experiment_id: str, parent: str, manifest: VariantManifest, trial, leader: str) -> str:
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
    return log_nested_run(experiment_id, parent, trial.name, tags, params, metrics)

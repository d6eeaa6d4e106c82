"""The pipeline flow: load → data → (optimize → evaluate → benchmark) per variant, beside the production version →
select → register → the champion/challenger gate → promote. Also the gate alone (`llmopt promote VERSION`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.retries import IO_RETRIES
from flows.stages import (
    Measurements,
    benchmark_fingerprint,
    duel,
    measure_variants,
    prepare_inputs,
    rank_and_report,
    workdir,
)
from tasks.decide.gate import Champion, Verdict, judge, judged_alone
from tasks.decide.history import apply_verdict, recover_unfinished_move
from tasks.decide.model_registry import (
    CANDIDATE,
    PRODUCTION,
    RegisteredVersion,
    Registration,
    production_version,
    register_variant,
    registered_version,
    set_candidate,
    version_label,
)
from tasks.decide.select import Leaderboard
from tasks.engines.manifest import VariantManifest
from tasks.inputs.data import PreparedData, read_split
from tasks.inputs.load import PreparedBase
from tasks.params import Config
from tasks.project_lock import project_lock
from tasks.report.run_report import ReportContext, write_run_report
from tasks.report.timeline import Span, write_timeline
from tasks.report.timings import StageClock
from tasks.report.tracking import (
    ParentRun,
    configure_tracking,
    experiment_url,
    log_run_report,
    parent_run,
    ui_base,
)


@dataclass(frozen=True)
class PipelineOutcome:
    leaderboard: Leaderboard
    registration: Registration | None  # the judged version (None: nothing qualified)
    verdict: Verdict
    promoted: bool
    registered_now: bool = True  # False for `llmopt promote`: the version existed, no alias was set
    highlights: tuple[str, ...] = ()  # a few lines before the last one: the report, the time, the UI

    def summary(self) -> str:
        """The run's last line: what happened to production, and why."""
        if self.promoted and self.registration is not None:
            return f"production → v{self.registration.version}: {self.verdict.reason}"
        if self.verdict.passed:
            return "production unchanged: it moved while this run decided (a lost race; see `llmopt history`)"
        return f"production unchanged: {self.verdict.reason}"


@dataclass(frozen=True)
class RunFacts:
    """What the run report states about the run itself: the project, the benchmark machine's fingerprint, the
    stage clock, when it started (UTC, ISO) and its MLflow parent run."""

    project: str
    fingerprint: dict
    clock: StageClock
    started: str
    run: ParentRun


@task(name="register", cache_policy=NO_CACHE, **IO_RETRIES)
def register_task(
    config: Config, folder: Path, manifest: VariantManifest, run_id: str, tags: dict, note: str
) -> Registration:
    return register_variant(config.project.name, folder, manifest, run_id, tags, note)


@flow(name="llmopt-prepare")
def prepare_flow(config: Config, root: Path) -> tuple[PreparedBase, PreparedData]:
    """Materialize the base model and the validated corpus splits (the DVC `prepare` stage)."""
    return prepare_inputs(config, root)


@flow(name="llmopt-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=1))
def pipeline_flow(config: Config, root: Path) -> PipelineOutcome:
    """Build, measure and rank every variant beside the production version; judge the winner against production
    (duel included) before anything is registered; register the winner as candidate and move production to it
    only when it beats production on the run's objective with confidence."""
    # a schedule tick takes the project lock here (`llmopt run` holds it already: taken again, it is a no-op)
    with project_lock(workdir(config, root), "scheduled run", get_run_logger().warning):
        return _pipeline(config, root)


def _pipeline(config: Config, root: Path) -> PipelineOutcome:
    clock, started = StageClock(), datetime.now(UTC).isoformat(timespec="seconds")
    with clock.stage("prepare"):
        base, data = prepare_inputs(config, root)
    fingerprint = benchmark_fingerprint(config)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash}
    with parent_run(experiment_id, config, lineage, fingerprint) as run:
        if note := recover_unfinished_move(config.project.name, f"run {run.run_id}"):
            get_run_logger().warning(note)
        production = production_version(config.project.name)
        registered = {version_label(PRODUCTION, production.version): production} if production else {}
        measured = measure_variants(config, root, base, data, 1, fingerprint, registered, clock)
        reports = workdir(config, root) / "reports"
        with clock.stage("rank"):
            board, runs = rank_and_report(config, measured, reports, run=run)
        with clock.stage("duel"):
            prompt = read_split(data.folder, "evaluation")[0]
            verdict = judge_winner(config, measured, board, production, prompt)
        with clock.stage("register"):
            registration = register_winner(config, measured, board, production, runs, fingerprint)
            actor = (f"run {run.run_id}", str(fingerprint["hash"]))
            promoted = apply_verdict(config.project.name, verdict, production, registration, actor)
        outcome = PipelineOutcome(board, registration, verdict, promoted)
        facts = RunFacts(config.project.name, fingerprint, clock, started, run)
        highlights = report_run(outcome, champion_of(measured, production), facts, reports, measured.spans)
    return _finish(replace(outcome, highlights=highlights))


@flow(name="llmopt-promote", task_runner=ThreadPoolTaskRunner(max_workers=1))
def promote_flow(config: Config, root: Path, version: str) -> PipelineOutcome:
    """The champion/challenger gate for one registered version: measured beside production and the baseline."""
    clock, started = StageClock(), datetime.now(UTC).isoformat(timespec="seconds")
    with clock.stage("prepare"):
        base, data = prepare_inputs(config, root)
    fingerprint = benchmark_fingerprint(config)
    experiment_id = configure_tracking(config.tracking, root)
    challenger = registered_version(config.project.name, version)
    production = production_version(config.project.name)
    registered = {version_label(CANDIDATE, version): challenger}
    registered |= {version_label(PRODUCTION, production.version): production} if production else {}
    only_baseline = config.model_copy(
        update={"variants": {config.select.baseline: config.variants[config.select.baseline]}}
    )
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash, "challenger": version}
    with parent_run(experiment_id, only_baseline, lineage, fingerprint, kind="promote") as run:
        measured = measure_variants(only_baseline, root, base, data, 1, fingerprint, registered, clock)
        out = workdir(config, root) / "promote"
        with clock.stage("rank"):
            board, _ = rank_and_report(only_baseline, measured, out, run=run)
            board = judged_alone(board, measured.registered[version_label(CANDIDATE, version)], version)
        with clock.stage("duel"):
            prompt = read_split(data.folder, "evaluation")[0]
            verdict = judge_winner(config, measured, board, production, prompt)
        with clock.stage("register"):
            registration = Registration(config.project.name, version, reused=True)
            actor = (f"llmopt promote (run {run.run_id})", str(fingerprint["hash"]))
            promoted = apply_verdict(config.project.name, verdict, production, registration, actor)
        outcome = PipelineOutcome(board, registration, verdict, promoted, registered_now=False)
        facts = RunFacts(config.project.name, fingerprint, clock, started, run)
        highlights = report_run(outcome, champion_of(measured, production), facts, out, measured.spans)
    return _finish(replace(outcome, highlights=highlights))


def register_winner(
    config: Config,
    measured: Measurements,
    board: Leaderboard,
    production: RegisteredVersion | None,
    runs: dict[str, str],
    fingerprint: dict,
) -> Registration | None:
    """The winner as the `candidate` version: production itself when it stayed the best (nothing new is
    registered), else the winner's variant registered (identical bytes reuse their version); None: no winner."""
    if (
        production is not None
        and board.winner == measured.registered[version_label(PRODUCTION, production.version)]
    ):
        registration = Registration(config.project.name, production.version, reused=True)
    elif board.winner is not None:
        tags = {
            "llmopt.fingerprint": str(fingerprint["hash"]),
            "llmopt.git_commit": str(fingerprint["git_commit"]),
        }
        folder = measured.space.bring_home(measured.folders[board.winner])  # from the store, checked
        manifest = measured.manifests[board.winner]
        registration = register_task(
            config, folder, manifest, runs[board.winner], tags, board.winner_summary()
        )
    else:
        return None
    set_candidate(registration)
    return registration


def champion_of(measured: Measurements, production: RegisteredVersion | None) -> tuple[str, str] | None:
    """(production version, the name it was measured under in this run), if there is a production version."""
    if production is None:
        return None
    return production.version, measured.registered[version_label(PRODUCTION, production.version)]


def report_run(
    outcome: PipelineOutcome,
    champion: tuple[str, str] | None,
    facts: RunFacts,
    folder: Path,
    spans: list[Span],
) -> tuple[str, ...]:
    """Write the run report (HTML + markdown) and the task timeline beside the leaderboard, log them and the
    stage timings on the parent run; return the lines the terminal shows before the verdict."""
    clock, parent_id = facts.clock, facts.run.run_id
    registration = outcome.registration
    timeline: list[Path] = []
    with contextlib.suppress(OSError, ValueError):  # the timeline is a picture of the run, not its record
        timeline = write_timeline(spans, folder)
    context = ReportContext(
        facts.project,
        facts.started,
        champion,
        outcome.verdict,
        outcome.promoted,
        registration.version if registration else None,
        facts.fingerprint,
        clock.line(),
        [folder / "tradeoff.png", folder / "speed.png"] + [p for p in timeline if p.suffix == ".png"],
    )
    try:
        files = write_run_report(outcome.leaderboard, context, folder) + timeline
        log_run_report(parent_id, files, clock.metrics())
    except Exception as exc:  # the decision is made and recorded; a report that fails must not undo the run
        get_run_logger().warning(f"run report not written: {exc}")
        files = [Path(f"(not written: {exc})")]
    ui, how = ui_base()
    failed = [
        f"Failed, left out of this run: {name}: {why}" for name, why in outcome.leaderboard.failed.items()
    ]
    return (
        *failed,
        f"Report: {files[0]} (also in MLflow, run {parent_id[:8]}, reports/)",
        f"Time: {clock.line()}",
        f"Compare in the MLflow UI ({how}): {experiment_url(ui, facts.run.experiment_id)}",
    )


def judge_winner(
    config: Config,
    measured: Measurements,
    board: Leaderboard,
    production: RegisteredVersion | None,
    prompt_text: str,
) -> Verdict:
    """The board's winner against production, after a duel of interleaved trials when they differ."""
    champion = None
    if production is not None:
        name = measured.registered[version_label(PRODUCTION, production.version)]
        if board.winner is not None and board.winner != name:
            duel(config, measured, (name, board.winner), prompt_text)
        score = next((row.score for row in board.rows if row.score.variant == name), None)
        champion = Champion(production.version, name, score, measured.trials[name])
    challenger_trials = measured.trials[board.winner] if board.winner else []
    return judge(board, champion, challenger_trials, config.select)


CONSOLE_ELSEWHERE = {"console": False}  # a record the console filter leaves to the log file (flows/logs.py)


def _finish(outcome: PipelineOutcome) -> PipelineOutcome:
    get_run_logger().info(outcome.summary(), extra=CONSOLE_ELSEWHERE)  # the command's last line says it
    return outcome

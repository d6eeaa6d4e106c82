"""The pipeline flow: load → data → (optimize → evaluate → benchmark) per variant, beside the production version →
select → register → the champion/challenger gate → promote. Also the gate alone (`llmopt promote VERSION`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.stages import Measurements, duel, measure_variants, prepare_inputs, rank_and_report, workdir
from tasks.config import Config
from tasks.decide.gate import Champion, Verdict, judge
from tasks.decide.history import move_production, record_refusal
from tasks.decide.registry import (
    RegisteredVersion,
    Registration,
    production_version,
    register_variant,
    registered_version,
    set_candidate,
)
from tasks.decide.select import Leaderboard
from tasks.engines.manifest import VariantManifest
from tasks.inputs.data import PreparedData, read_split
from tasks.inputs.load import PreparedBase
from tasks.measure.fingerprint import machine_fingerprint
from tasks.report.tracking import configure_tracking, parent_run


@dataclass(frozen=True)
class PipelineOutcome:
    leaderboard: Leaderboard
    registration: Registration | None  # None: nothing qualified, nothing registered
    verdict: Verdict
    promoted: bool

    def summary(self) -> str:
        """The run's last line: what happened to production, and why."""
        if self.promoted and self.registration is not None:
            return f"production → v{self.registration.version}: {self.verdict.reason}"
        return f"production unchanged: {self.verdict.reason}"


@task(name="register", cache_policy=NO_CACHE)
def register_task(
    config: Config, folder: Path, manifest: VariantManifest, run_id: str, tags: dict, note: str
) -> Registration:
    return register_variant(config.project.name, folder, manifest, run_id, tags, note)


@flow(name="llmopt-prepare")
def prepare_flow(config: Config, root: Path) -> tuple[PreparedBase, PreparedData]:
    """Materialize the base model and the validated corpus splits (the DVC `prepare` stage)."""
    return prepare_inputs(config, root)


@flow(name="llmopt-pipeline")
def pipeline_flow(config: Config, root: Path) -> PipelineOutcome:
    """Build, measure and rank every variant beside the production version; register the winner as candidate and
    move production to it only when it beats production on the run's objective with confidence."""
    base, data = prepare_inputs(config, root)
    fingerprint = machine_fingerprint(config.target.threads)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash}
    with parent_run(experiment_id, config, lineage, fingerprint) as parent_id:
        production = production_version(config.project.name)
        registered = {f"production-v{production.version}": production} if production else {}
        measured = measure_variants(config, root, base, data, trials=1, registered=registered)
        reports = workdir(config, root) / "reports"
        board, runs = rank_and_report(config, measured, reports, (experiment_id, parent_id), [], {})
        registration = None
        if board.winner is not None:
            tags = {
                "llmopt.fingerprint": str(fingerprint["hash"]),
                "llmopt.git_commit": str(fingerprint["git_commit"]),
            }
            folder, manifest = measured.folders[board.winner], measured.manifests[board.winner]
            registration = register_task(
                config, folder, manifest, runs[board.winner], tags, board.winner_summary()
            )
            set_candidate(registration)
        texts = read_split(data.folder, "evaluation")
        decision = (f"run {parent_id}", str(fingerprint["hash"]), texts[0])
        verdict, promoted = gate_and_move(config, measured, board, production, registration, decision)
    return _finish(PipelineOutcome(board, registration, verdict, promoted))


@flow(name="llmopt-promote")
def promote_flow(config: Config, root: Path, version: str) -> PipelineOutcome:
    """The champion/challenger gate for one registered version: measured beside production and the baseline."""
    base, data = prepare_inputs(config, root)
    fingerprint = machine_fingerprint(config.target.threads)
    experiment_id = configure_tracking(config.tracking, root)
    challenger = registered_version(config.project.name, version)
    production = production_version(config.project.name)
    registered = {f"candidate-v{version}": challenger}
    registered |= {f"production-v{production.version}": production} if production else {}
    only_baseline = config.model_copy(
        update={"variants": {config.select.baseline: config.variants[config.select.baseline]}}
    )
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash, "challenger": version}
    with parent_run(experiment_id, only_baseline, lineage, fingerprint, kind="promote") as parent_id:
        measured = measure_variants(only_baseline, root, base, data, trials=1, registered=registered)
        out = workdir(config, root) / "promote"
        board, _ = rank_and_report(only_baseline, measured, out, (experiment_id, parent_id), [], {})
        name = measured.registered[f"candidate-v{version}"]
        qualifies = any(row.score.variant == name and row.qualifies for row in board.rows)
        board = replace(board, winner=name if qualifies else None)
        registration = Registration(config.project.name, version, reused=True)
        texts = read_split(data.folder, "evaluation")
        decision = (f"llmopt promote (run {parent_id})", str(fingerprint["hash"]), texts[0])
        verdict, promoted = gate_and_move(config, measured, board, production, registration, decision)
    return _finish(PipelineOutcome(board, registration, verdict, promoted))


def gate_and_move(
    config: Config,
    measured: Measurements,
    board: Leaderboard,
    production: RegisteredVersion | None,
    registration: Registration | None,
    decision: tuple[str, str, str],
) -> tuple[Verdict, bool]:
    """Judge the board's winner against production (after a duel of interleaved trials), store the verdict on the
    version, and move production if it passed (under the registry lock); every decision is recorded.

    `decision` is (who decides, the machine fingerprint, the benchmark prompt text).
    """
    actor, fingerprint, prompt_text = decision
    champion = None
    if production is not None:
        name = measured.registered[f"production-v{production.version}"]
        if board.winner is not None and board.winner != name:
            duel(config, measured, (name, board.winner), prompt_text)
        score = next((row.score for row in board.rows if row.score.variant == name), None)
        champion = Champion(production.version, name, score, measured.trials[name])
    challenger_trials = measured.trials[board.winner] if board.winner else []
    verdict = judge(board, champion, challenger_trials, config.select)
    model, before = config.project.name, production.version if production else None
    if registration is None:
        if production is not None:
            record_refusal(model, actor, before, None, verdict.reason)
        return verdict, False
    _store_verdict(model, registration.version, verdict, fingerprint)
    if not verdict.passed:
        record_refusal(model, actor, before, registration.version, verdict.reason)
        return verdict, False
    moved = move_production(model, registration.version, before, actor, "gate", verdict.reason, verdict.tag())
    return verdict, moved


def _store_verdict(model: str, version: str, verdict: Verdict, fingerprint: str) -> None:
    """The verdict with its evidence on the model version (shown in the MLflow UI's version page)."""
    from mlflow import MlflowClient

    evidence = {
        "verdict": verdict.tag(),
        "challenger_version": version,
        "champion_version": verdict.champion_version,
        "fingerprint": fingerprint,
        **verdict.evidence,
    }
    MlflowClient().set_model_version_tag(model, version, "llmopt.verdict", json.dumps(evidence)[:5000])


def _finish(outcome: PipelineOutcome) -> PipelineOutcome:
    get_run_logger().info(outcome.summary())
    return outcome

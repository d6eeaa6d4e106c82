"""The pipeline flow: load → data → (optimize → evaluate → benchmark) per variant → select → register → promote."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.stages import measure_variants, prepare_inputs, rank_and_report, workdir
from tasks.config import Config
from tasks.decide.registry import Registration, gate_verdict, promote, register_variant
from tasks.decide.select import Leaderboard
from tasks.engines.manifest import VariantManifest
from tasks.inputs.data import PreparedData
from tasks.inputs.load import PreparedBase
from tasks.measure.fingerprint import machine_fingerprint
from tasks.report.tracking import configure_tracking, parent_run


@dataclass(frozen=True)
class PipelineOutcome:
    leaderboard: Leaderboard
    registration: Registration
    aliases: list[str]
    gate_reason: str


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
    """Build, measure and rank every variant, then register and promote the winner."""
    base, data = prepare_inputs(config, root)
    fingerprint = machine_fingerprint(config.target.threads)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash}
    with parent_run(experiment_id, config, lineage, fingerprint) as parent_id:
        measured = measure_variants(config, root, base, data, trials=1)
        reports = workdir(config, root) / "reports"
        board, runs = rank_and_report(config, measured, reports, (experiment_id, parent_id), [], {})
        verdict = gate_verdict(board)
        tags = {
            "llmopt.fingerprint": str(fingerprint["hash"]),
            "llmopt.git_commit": str(fingerprint["git_commit"]),
        }
        winner_dir = workdir(config, root) / "variants" / board.winner
        registration = register_task(
            config,
            winner_dir,
            measured.manifests[board.winner],
            runs[board.winner],
            tags,
            board.winner_summary(),
        )
        aliases = promote(registration, verdict)
    return PipelineOutcome(board, registration, aliases, verdict.reason)

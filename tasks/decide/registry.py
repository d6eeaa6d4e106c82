"""register / promote: MLflow Model Registry versions and aliases, with lineage tags and a promotion gate."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

from tasks.decide.select import Leaderboard
from tasks.engines.manifest import VariantManifest
from tasks.errors import RegistryError

VARIANT_ARTIFACT = "variant"  # the artifact key pyfunc_model.py reads
CANDIDATE = "candidate"
PRODUCTION = "production"


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    reused: bool


@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    reason: str
    ppl_ratio: float
    threshold: float


def gate_verdict(board: Leaderboard) -> GateVerdict:
    """The evidence for promoting the winner: its accuracy verdict from selection, in words for the registry.

    Selection only crowns a variant within budget (or the baseline), so a fresh winner passes; the verdict is
    what the registry records and what `promote` obeys.
    """
    row = next(r for r in board.rows if r.score.variant == board.winner)
    limit = 1 + board.max_ppl_increase
    passed = row.within_budget
    reason = (
        f"perplexity ratio {row.ppl_ratio:.4f}, {board.confidence:.0%} CI upper bound {row.ppl_ratio_high:.4f} "
        f"{'≤' if row.ppl_ratio_high <= limit else '>'} {limit:.4f}; cloze McNemar p {row.cloze_p_value:.2f}"
    )
    return GateVerdict(passed, reason, row.ppl_ratio, limit)


def register_variant(
    model_name: str,
    variant_dir: Path,
    manifest: VariantManifest,
    run_id: str,
    tags: dict[str, str],
    description: str,
) -> Registration:
    """Log the variant's weights as a pyfunc model in its run and register it; identical bytes reuse a version."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    for existing in _versions(client, model_name):
        if existing.tags.get("llmopt.content_hash") == manifest.content_hash:
            return Registration(model_name, str(existing.version), reused=True)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("pyfunc_model.py")),
            artifacts={VARIANT_ARTIFACT: str(variant_dir)},
            pip_requirements=[f"{p}=={metadata.version(p)}" for p in ("torch", "transformers", "mlflow")],
        )
    all_tags = {
        **tags,
        "llmopt.variant": manifest.name,
        "llmopt.content_hash": manifest.content_hash,
        "llmopt.recipe_hash": manifest.recipe_hash,
        "llmopt.base_hash": manifest.base_hash,
        "llmopt.data_hash": manifest.data_hash,
    }
    version = mlflow.register_model(info.model_uri, model_name, tags=all_tags)
    client.update_model_version(model_name, version.version, description=description)
    return Registration(model_name, str(version.version), reused=False)


def promote(registration: Registration, verdict: GateVerdict) -> list[str]:
    """Alias `candidate` always; `production` only when the gate passed. Returns the aliases set."""
    from mlflow import MlflowClient

    client = MlflowClient()
    name, version = registration.name, registration.version
    client.set_model_version_tag(
        name, version, "llmopt.gate", f"{'passed' if verdict.passed else 'refused'}: {verdict.reason}"
    )
    client.set_registered_model_alias(name, CANDIDATE, version)
    if not verdict.passed:
        return [CANDIDATE]
    previous = current_version(name, PRODUCTION)
    if previous is not None and previous != version:
        client.set_model_version_tag(name, version, "llmopt.previous_production", previous)
    client.set_registered_model_alias(name, PRODUCTION, version)
    return [CANDIDATE, PRODUCTION]


def current_version(model_name: str, alias: str) -> str | None:
    """The version an alias points to, or None when the model or alias does not exist."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return str(MlflowClient().get_model_version_by_alias(model_name, alias).version)
    except MlflowException:
        return None


def resolve_alias(model_name: str, alias: str, dest: Path) -> tuple[str, Path]:
    """Download `models:/<name>@<alias>` and return (version, folder of the variant inside it)."""
    import mlflow

    version = current_version(model_name, alias)
    if version is None:
        raise RegistryError(f"no model version {model_name}@{alias} in the registry; run `llmopt run` first")
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{model_name}@{alias}", dst_path=str(dest)))
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    try:
        relative = mlmodel["flavors"]["python_function"]["artifacts"][VARIANT_ARTIFACT]["path"]
    except (KeyError, TypeError):
        raise RegistryError(f"{model_name}@{alias} (version {version}) was not logged by llmopt") from None
    return version, local / relative


def _versions(client, model_name: str) -> list:
    from mlflow.exceptions import MlflowException

    try:
        return list(client.search_model_versions(f"name='{model_name}'"))
    except MlflowException:
        return []

"""What the measuring loop measures, decided before it runs anything: the order (the baseline first, everyone's
reference), which models get a served-capacity measurement, which get only a short benchmark (outside the
accuracy budget, so never selected), and which may fail without stopping the run. flows/stages.py submits the
work; these are its decisions, as plain functions."""

from __future__ import annotations

from tasks.decide.accuracy import evaluation_accuracy
from tasks.engines.manifest import VariantManifest
from tasks.measure.evaluate import VariantEvaluation
from tasks.params import Config, VariantConfig, is_peer_recipe


def baseline_first(config: Config) -> list[tuple[str, VariantConfig]]:
    """The variants, the baseline first (every evaluation pairs with its, and waits for it)."""
    base = config.select.baseline
    return [(base, config.variants[base])] + [(n, v) for n, v in config.variants.items() if n != base]


def served_here(config: Config, name: str, manifest: VariantManifest) -> bool:
    """Whether the benchmark measures this model's served capacity: not for the peer row (never selected), and
    for the baseline only when the objective is `serving` (it is the reference the speedups are read against
    then; otherwise its fp32 torch engine, which on a CPU steps each served request alone, would cost more time
    than all the candidates together for a figure nobody chooses by)."""
    if is_peer_recipe(manifest.recipe):
        return False
    return name != config.select.baseline or config.select.objective == "serving"


def outside_budget(
    config: Config,
    manifests: dict[str, VariantManifest],
    evaluations: dict[str, VariantEvaluation],
    exclude: set[str],
) -> list[str]:
    """This run's variants whose accuracy is outside the budget: they can never be selected, so a short benchmark
    says enough about them. Not the baseline, not a peer row, not those in `exclude` (the ones standing in for a
    registered version: production's trials feed the gate, the same benchmark each time)."""
    base = evaluations[config.select.baseline]
    return [
        name
        for name in config.variants
        if name != config.select.baseline
        and name not in exclude
        and name in evaluations
        and not is_peer_recipe(manifests[name].recipe)
        and not evaluation_accuracy(base, evaluations[name], config.select).within_budget
    ]


def may_fail_alone(config: Config, name: str, stand_ins: dict[str, str]) -> bool:
    """Whether a model whose engine refused its artifact can be left out while the run goes on: a variant of this
    run, neither the baseline (everyone's reference) nor the stand-in of a registered version (the champion must be
    measured)."""
    return name in config.variants and name != config.select.baseline and name not in stand_ins.values()

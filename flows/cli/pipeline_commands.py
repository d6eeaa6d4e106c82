"""Commands over the pipeline and the registry: run, promote, rollback, history, bench, prepare."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.app import DebugOption, ParamsOption, app
from flows.cli.render import (
    print_comparison,
    print_history,
    print_leaderboard,
    print_outcome,
    print_search,
    print_spread,
)
from flows.cli.session import CommandSession, console
from tasks.errors import ConfigError, GateError, RegistryError
from tasks.params import Config

# What a run imports (the slowest first) while Prefect's temporary server starts: session.flow_run
RUN_IMPORTS = ("transformers.modeling_utils", "great_expectations", "mlflow", "flows.pipeline")


@app.command()
def run(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Run the whole pipeline: load → optimize → evaluate → benchmark → select → register → promote."""
    with CommandSession(debug) as session:
        config, root = session.flow_run(params, "run", imports=RUN_IMPORTS)
        from flows.cluster import on_cluster
        from flows.pipeline import pipeline_flow

        outcome = on_cluster(pipeline_flow, config)(config, root)
        print_outcome(outcome)


@app.command()
def promote(
    version: Annotated[str, typer.Argument(help="The registered model version to move production to.")],
    params: ParamsOption = Path("params.yaml"),
    force: Annotated[
        bool, typer.Option("--force", help="Skip the champion/challenger gate (recorded as forced).")
    ] = False,
    reason: Annotated[
        str | None, typer.Option(help="Why (required with --force; kept in the history).")
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Move production to VERSION if it beats the current production version in the champion/challenger gate
    (both measured now, on this machine, beside the baseline); with --force --reason, move it without the gate."""
    with CommandSession(debug) as session:
        config, root = session.setup(params)
        if force:
            session.lock(config, root, "promote --force")
            _forced_move(config, root, version, reason, "forced", "llmopt promote --force")
            return
        if _current_production(config, root, version) == version:
            console.print(f"production is already v{version}; nothing to do")
            return
        config, root = session.flow_run(params, "promote", imports=("flows.pipeline", "mlflow"))
        from flows.cluster import on_cluster
        from flows.pipeline import promote_flow

        outcome = on_cluster(promote_flow, config)(config, root, version)
        print_outcome(outcome, last_line=outcome.promoted)
        if not outcome.promoted:
            raise GateError(outcome.summary())  # a refusal exits 1 with the reason as its one error line


@app.command()
def rollback(
    params: ParamsOption = Path("params.yaml"),
    reason: Annotated[str, typer.Option(help="Why (kept in the history).")] = "rollback",
    debug: DebugOption = False,
) -> None:
    """Move production back to the version it pointed to before its last move (recorded in the history)."""
    with CommandSession(debug) as session:
        config, root = session.setup(params)
        session.lock(config, root, "rollback")
        from tasks.decide.history import rollback_target

        _configure_tracking(config, root)
        current, previous = rollback_target(config.project.name)
        _forced_move(config, root, previous, reason, "rollback", "llmopt rollback", expected=current)


@app.command()
def history(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Every decision about production: moves (gate, forced, rollback) and refusals, oldest first."""
    with CommandSession(debug) as session:
        config, root = session.setup(params)
        from tasks.decide.history import history as production_history

        _configure_tracking(config, root)
        print_history(config.project.name, production_history(config.project.name))


@app.command()
def bench(
    params: ParamsOption = Path("params.yaml"),
    trials: Annotated[
        int,
        typer.Option(min=1, max=20, help="Benchmark every variant this many times; the spread is reported."),
    ] = 2,
    compare: Annotated[
        Path | None,
        typer.Option(
            help="A previous bench.json (or its folder) to compare with; refused from another machine."
        ),
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Benchmark all variants side by side (batch sizes, TTFT by prompt length, latency percentiles, roofline),
    repeated `--trials` times; writes .llmopt/bench/ (table, CSV, plots, bench.json) and logs an MLflow run."""
    with CommandSession(debug) as session:
        config, root = session.flow_run(params, "bench", imports=("flows.bench", "mlflow"))
        from flows.bench import bench_flow
        from flows.cluster import on_cluster

        outcome = on_cluster(bench_flow, config)(config, root, trials, compare.resolve() if compare else None)
        print_leaderboard(outcome.leaderboard)
        for name, why in outcome.leaderboard.failed.items():
            console.print(
                f"Failed, left out of this run: {name}: {why}", soft_wrap=True, highlight=False, markup=False
            )
        print_spread(outcome.spread)
        if outcome.previous is not None:
            print_comparison(outcome.previous, outcome.spread)
        console.print(
            f"Reports: {outcome.folder} (bench.json, spread.csv, leaderboard.*, tradeoff.png, speed.png)"
        )


@app.command()
def prepare(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Materialize the base model folder and the validated calibration/evaluation splits."""
    with CommandSession(debug) as session:
        config, root = session.flow_run(params, "prepare", imports=("flows.pipeline", "great_expectations"))
        from flows.pipeline import prepare_flow

        base, data = prepare_flow(config, root)
        passages = ", ".join(f"{count} {split}" for split, count in data.counts.items())
        console.print(
            f"base model {base.path} (sha256 {base.content_hash[:12]}); data: {passages} passages in {data.folder}",
            soft_wrap=True,
        )


def _configure_tracking(config: Config, root: Path) -> None:
    """Point MLflow at the project's store, and finish or undo a production move a killed process left half done
    (saying which) before this command reads or moves production."""
    from tasks.decide.history import recover_unfinished_move
    from tasks.report.tracking import configure_tracking

    configure_tracking(config.tracking, root)
    note = recover_unfinished_move(config.project.name, "llmopt recovery")
    if note:
        console.print(note)


def _current_production(config: Config, root: Path, version: str) -> str | None:
    """Production's version; a version that does not exist is a one-line error before any work starts."""
    from tasks.decide.model_registry import PRODUCTION, current_version, registered_version

    _configure_tracking(config, root)
    registered_version(config.project.name, version)
    return current_version(config.project.name, PRODUCTION)


def _forced_move(
    config: Config,
    root: Path,
    version: str,
    reason: str | None,
    kind: str,
    actor: str,
    expected: str | None = None,
) -> None:
    """Move production without the gate; the reason is required and recorded. `expected`: where production
    must still point (rollback decided on it), else wherever it points now."""
    from tasks.decide.history import move_production

    if not reason:
        raise ConfigError("--force needs --reason TEXT (it is kept in the production history)")
    before = _current_production(config, root, version)
    if before == version:
        console.print(f"production is already v{version}; nothing to do")
        return
    before = expected if expected is not None else before
    tag = f"{kind}: {reason}"
    if not move_production(config.project.name, version, before, actor, kind, reason, tag):
        raise RegistryError("production moved while this command ran; see `llmopt history`")
    console.print(f"production → v{version} ({kind}: {reason}); was {f'v{before}' if before else 'none'}")


@app.command()
def search(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Search params.yaml's `search.space` (every combination of its choices) beside params.yaml's own variants:
    proxies for all (size, KL to the baseline, a short decode), then a race against the leader with paired
    statistics, the winner confirmed on fresh measurements. Writes .llmopt/search/ and one MLflow run per trial; a
    confirmed winner is registered and goes through the champion/challenger gate, as `llmopt promote` (unless
    search.promote is false)."""
    with CommandSession(debug) as session:
        config, root = session.flow_run(
            params, "search", imports=("transformers.modeling_utils", "mlflow", "flows.search")
        )
        from flows.search import search_flow

        report = search_flow(config, root)
        print_search(report)
        if report.registration is None:
            return
        version = report.registration.version
        if _current_production(config, root, version) == version:
            console.print(f"production is already v{version}; nothing to move")
            return
        from flows.cluster import on_cluster
        from flows.pipeline import promote_flow

        console.print(f"the gate: v{version} against production, both measured now beside the baseline")
        print_outcome(
            on_cluster(promote_flow, config)(config, root, version)
        )  # a refusal is an outcome, as in run

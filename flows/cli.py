"""The `llmopt` command line: thin commands over the flows, one-line errors, rich output."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tasks.config import Config, load_config
from tasks.errors import ConfigError, GateError, LlmoptError, RegistryError

app = typer.Typer(
    help="llmopt: optimize a causal LM, measure accuracy and speed honestly, register and serve the winner.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console(stderr=True)
ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="Pipeline settings (YAML).")]
DebugOption = Annotated[
    bool,
    typer.Option("--debug", help="Show everything on the console: library logs, Prefect's, full tracebacks."),
]


def main() -> None:
    """Console-script entry point."""
    app()


@app.command()
def run(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Run the whole pipeline: load → optimize → evaluate → benchmark → select → register → promote."""
    with _user_errors(debug):
        config, root = _setup_flow_run(params, debug, "run")
        from flows.cluster import on_cluster
        from flows.pipeline import pipeline_flow

        outcome = on_cluster(pipeline_flow, config)(config, root)
        _print_outcome(outcome)


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
    with _user_errors(debug):
        config, root = _setup(params, debug)
        if force:
            _forced_move(config, root, version, reason, "forced", "llmopt promote --force")
            return
        if _current_production(config, root, version) == version:
            console.print(f"production is already v{version}; nothing to do")
            return
        config, root = _setup_flow_run(params, debug, "promote")
        from flows.cluster import on_cluster
        from flows.pipeline import promote_flow

        outcome = on_cluster(promote_flow, config)(config, root, version)
        _print_outcome(outcome, last_line=outcome.promoted)
        if not outcome.promoted:
            raise GateError(outcome.summary())  # a refusal exits 1 with the reason as its one error line


@app.command()
def rollback(
    params: ParamsOption = Path("params.yaml"),
    reason: Annotated[str, typer.Option(help="Why (kept in the history).")] = "rollback",
    debug: DebugOption = False,
) -> None:
    """Move production back to the version it pointed to before its last move (recorded in the history)."""
    with _user_errors(debug):
        config, root = _setup(params, debug)
        from tasks.decide.history import rollback_target

        _configure_tracking(config, root)
        current, previous = rollback_target(config.project.name)
        _forced_move(config, root, previous, reason, "rollback", "llmopt rollback", expected=current)


@app.command()
def history(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Every decision about production: moves (gate, forced, rollback) and refusals, oldest first."""
    with _user_errors(debug):
        config, root = _setup(params, debug)
        from tasks.decide.history import history as production_history

        _configure_tracking(config, root)
        table = Table(title=f"{config.project.name}: production history")
        for column in ("time (UTC)", "by", "kind", "from", "to", "moved", "reason"):
            table.add_column(column, overflow="fold")
        for move in production_history(config.project.name):
            table.add_row(
                move.time,
                move.actor,
                move.kind,
                f"v{move.from_version}" if move.from_version else "—",
                f"v{move.to_version}" if move.to_version else "—",
                "yes" if move.moved else "no",
                move.reason,
            )
        _wide_console().print(table)


def _configure_tracking(config: Config, root: Path) -> None:
    from tasks.report.tracking import configure_tracking

    configure_tracking(config.tracking, root)


def _current_production(config: Config, root: Path, version: str) -> str | None:
    """Production's version; a version that does not exist is a one-line error before any work starts."""
    from tasks.decide.registry import PRODUCTION, current_version, registered_version

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


def _print_outcome(outcome, last_line: bool = True) -> None:
    """The leaderboard, the registration, and as the last line what happened to production and why (unless the
    caller ends with it as an error)."""
    _print_leaderboard(outcome.leaderboard)
    reg = outcome.registration
    if reg is not None and outcome.registered_now:
        reused = " (same bytes as before, reused)" if reg.reused else ""
        console.print(
            f"Registered [bold]{reg.name}[/] version {reg.version}{reused} → alias candidate", soft_wrap=True
        )
    for line in outcome.highlights:
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if last_line:
        console.print(outcome.summary(), soft_wrap=True, highlight=False)


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
    with _user_errors(debug):
        config, root = _setup_flow_run(params, debug, "bench")
        from flows.bench import bench_flow
        from flows.cluster import on_cluster

        outcome = on_cluster(bench_flow, config)(config, root, trials, compare.resolve() if compare else None)
        _print_leaderboard(outcome.leaderboard)
        _print_spread(outcome.spread)
        if outcome.previous is not None:
            _print_comparison(outcome.previous, outcome.spread)
        console.print(
            f"Reports: {outcome.folder} (bench.json, spread.csv, leaderboard.*, tradeoff.png, speed.png)"
        )


@app.command()
def prepare(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Materialize the base model folder and the validated calibration/evaluation splits."""
    with _user_errors(debug):
        config, root = _setup_flow_run(params, debug, "prepare")
        from flows.pipeline import prepare_flow

        base, data = prepare_flow(config, root)
        console.print(
            f"base model {base.path} (sha256 {base.content_hash[:12]}); data {data.counts}", soft_wrap=True
        )


@app.command()
def serve(
    params: ParamsOption = Path("params.yaml"),
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="What to serve, repeatable: a registry alias of this project's model, name@alias or name/version "
            "(default: serve.models). The first answers requests that name no model.",
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default: serve.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: serve.port).")] = None,
    debug: DebugOption = False,
) -> None:
    """Serve registered models over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions (streaming
    too), TGI-compatible /generate and /generate_stream, /health, /ready, Prometheus /metrics. Concurrent requests
    are batched per model; when an alias moves (checked every serve.watch_s) the new version is verified, loaded
    and swapped in without dropping requests. With $LLMOPT_API_KEY set (serve.api_key_env), clients need it."""
    with _user_errors(debug):
        config, root = _setup(params, debug)
        from serving.app import serve_registered_models

        refs = model or config.serve.models
        serve_registered_models(config, root, refs, host or config.serve.host, port or config.serve.port)


@app.command()
def loadtest(
    params: ParamsOption = Path("params.yaml"),
    url: Annotated[
        str | None, typer.Option(help="The server (default: http://serve.host:serve.port).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model to drive, as the server names it (default: its first).")
    ] = None,
    concurrency: Annotated[
        str | None, typer.Option(help="Comma-separated levels, e.g. 1,4,16 (default: loadtest.concurrency).")
    ] = None,
    requests: Annotated[
        int | None, typer.Option(help="Requests per level (default: loadtest.requests_per_level).")
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Drive a running `llmopt serve` at each concurrency level with the same seeded requests (evaluation-split
    prompts of varied length, varied max_tokens, greedy, streamed); print requests/s, aggregate tok/s, TTFT and
    end-to-end p50/p95, and log them to MLflow beside the model version served, with the engine's offline batch
    throughput from the pipeline's benchmark as the reference ceiling."""
    with _user_errors(debug):
        config, root = _setup(params, debug)
        from serving.loadtest import load_test, log_load_test, offline_ceiling, request_set, served_model
        from tasks.inputs.data import read_split
        from tasks.report.tracking import configure_tracking

        cfg = config.loadtest.model_copy(
            update={k: v for k, v in {"requests_per_level": requests}.items() if v is not None}
        )
        levels = _levels(concurrency) if concurrency else cfg.concurrency
        base = url or f"http://{config.serve.host}:{config.serve.port}"
        api_key = os.environ.get(config.serve.api_key_env) or None
        entry = served_model(base, model, api_key)
        data = root / config.project.workdir / "data"
        if not (data / "evaluation.jsonl").is_file():
            raise ConfigError(
                f"{data}: no prepared evaluation split to draw prompts from; run `llmopt run` first"
            )
        batch = request_set(read_split(data, "evaluation"), cfg, config.serve.max_new_tokens)
        console.print(
            f"load test: {entry['served_id']} ({entry['variant']}) at {base}, levels {levels}, {len(batch)} requests each"
        )
        results = load_test(base, entry["id"], batch, levels, api_key)
        configure_tracking(config.tracking, root)
        registered, _, version = entry["served_id"].rpartition("/")
        ceiling = offline_ceiling(registered, version)
        settings = {"url": base, "levels": levels, **cfg.model_dump(exclude={"concurrency"})}
        run_id = log_load_test(config.tracking.experiment, entry, results, ceiling, settings)
        _print_load_test(results, ceiling)
        console.print(f"logged to MLflow run {run_id} (tag llmopt.loadtest_run on {registered} v{version})")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency: comma-separated positive integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency: comma-separated positive integers, got {text!r}")
    return levels


def _print_load_test(results: list, ceiling: tuple[int, float] | None) -> None:
    table = Table(title="Load test (greedy, streamed; latencies in ms)")
    columns = (
        "clients",
        "req/s",
        "tok/s",
        "TTFT p50",
        "TTFT p95",
        "e2e p50",
        "e2e p95",
        "decode tok/s",
        "prefill",
        "errors",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r.concurrency),
            f"{r.requests_s:.2f}",
            f"{r.tok_s:.0f}",
            f"{r.ttft_p50_ms:.0f}",
            f"{r.ttft_p95_ms:.0f}",
            f"{r.e2e_p50_ms:.0f}",
            f"{r.e2e_p95_ms:.0f}",
            f"{r.decode_tok_s:.0f}",
            f"{r.prefill_share:.0%}",
            str(r.errors),
        )
    Console(width=None if sys.stdout.isatty() else 130).print(table)  # piped: do not squeeze to 80
    console.print(
        "tok/s: generated tokens of all requests per second; decode tok/s: the same inside batched decode steps "
        "only; prefill: share of the time the engine spent on prompts (every running request waits for it)."
    )
    if ceiling:
        top = results[-1]
        console.print(
            f"offline ceiling (pipeline benchmark, decode only, batch {ceiling[0]}): {ceiling[1]:.0f} tok/s; at "
            f"{top.concurrency} clients the server decodes at {top.decode_tok_s / ceiling[1]:.0%} of it and "
            f"delivers {top.tok_s / ceiling[1]:.0%} of it end to end"
        )


services_app = typer.Typer(
    help="Services llmopt starts itself (scripts under infra/): the Prefect server that `llmopt schedule` needs.",
    no_args_is_help=True,
)
app.add_typer(services_app, name="services")


@services_app.command("up")
def services_up(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Start the configured services in the background (no-op for those already up) and wait until they answer."""
    with _user_errors(debug):
        from flows.services import start

        _each_service(load_config(params), params, start)


@services_app.command("down")
def services_down(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Stop the services llmopt started (their data stays under project.workdir/services)."""
    with _user_errors(debug):
        from flows.services import stop

        _each_service(load_config(params), params, stop, last_first=True)


@services_app.command("status")
def services_status(params: ParamsOption = Path("params.yaml"), debug: DebugOption = False) -> None:
    """Whether each configured service is up and answering."""
    with _user_errors(debug):
        from flows.services import status

        _each_service(load_config(params), params, status)


def _each_service(config: Config, params: Path, action, last_first: bool = False) -> None:
    """Apply `action` (start, stop, status) to every configured service and print its one-line answer."""
    from flows.services import configured_services

    services = configured_services(config, params.resolve().parent)
    for service in reversed(services) if last_first else services:
        console.print(action(service), soft_wrap=True, highlight=False)


@app.command()
def schedule(
    params: ParamsOption = Path("params.yaml"),
    once: Annotated[
        bool,
        typer.Option("--once", help="Trigger one run through the deployment now, wait, print its result."),
    ] = False,
    keep_schedule_on_exit: Annotated[
        bool, typer.Option(hidden=True, help="Used by --once: stopping does not pause the deployment.")
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Run the pipeline on params.yaml's schedule (cron or interval): a Prefect deployment served against the
    Prefect server, which is started first if it is not up. Runs until interrupted (Ctrl-C pauses the schedule);
    one pipeline run at a time. The Prefect UI (services.prefect_port) shows the runs. With schedule.work_pool the
    deployment goes to that work pool instead and this returns at once: the pool's workers run it."""
    with _user_errors(debug):
        config, root = _setup_scheduled(params, debug)
        from flows.schedule import deploy_to_pool, deployment_name, run_on_pool, run_once, serve_schedule

        pool = config.schedule.work_pool
        if pool and once:
            console.print(
                f"Triggering {deployment_name(config)} on work pool {pool}", soft_wrap=True, highlight=False
            )
            console.print(run_on_pool(config, params), soft_wrap=True, highlight=False)
            return
        if pool:
            deploy_to_pool(config, params)
            when = ", ".join(f"{key} {value}" for key, value in config.schedule.when.items())
            console.print(
                f"Deployed {deployment_name(config)} ({when}) on work pool {pool}: its workers run it "
                f"(services.prefect_worker, or `prefect worker start --pool {pool}`). Prefect UI "
                f"http://127.0.0.1:{config.services.prefect_port}.",
                soft_wrap=True,
                highlight=False,
            )
            return
        if once:
            log = Path(os.environ["PREFECT_HOME"]) / "schedule-once.log"
            console.print(
                f"Triggering {deployment_name(config)} (runner log {log})", soft_wrap=True, highlight=False
            )
            console.print(run_once(config, params, log), soft_wrap=True, highlight=False)
            return
        when = ", ".join(f"{key} {value}" for key, value in config.schedule.when.items())
        console.print(
            f"Serving {deployment_name(config)} ({when}); Prefect UI http://127.0.0.1:{config.services.prefect_port}."
            " Ctrl-C stops.",
            soft_wrap=True,
            highlight=False,
        )
        serve_schedule(config, params, pause_on_shutdown=not keep_schedule_on_exit)


def _setup_scheduled(params: Path, debug: bool) -> tuple[Config, Path]:
    """Prefect pointed at the Prefect server (before Prefect is first imported: it reads its settings once), the
    pre-flight checks (the schedule's too), then the services up."""
    from flows.services import prefect_api_url, start

    os.environ["PREFECT_API_URL"] = prefect_api_url(load_config(params))
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "5")  # seconds between looks for due runs
    config, root = _setup_flow_run(params, debug, "schedule", (_check_schedule,), starts_services=True)
    _each_service(config, params, start)
    return config, root


def _check_schedule(config: Config) -> None:
    from flows.schedule import (
        check_schedule,  # imports Prefect: only once its settings are in the environment
    )

    check_schedule(config)


def _setup(params: Path, debug: bool) -> tuple[Config, Path]:
    global _log_file
    _log_file = None  # set again once this command's pre-flight checks pass
    config = load_config(params)
    root = params.resolve().parent
    _configure_environment(root / config.project.workdir, debug)
    return config, root


def _configure_environment(workdir: Path, debug: bool) -> None:
    """Embedded defaults (Prefect home inside the project, offline hub) before Prefect is first imported."""
    os.environ.setdefault("PREFECT_HOME", str(workdir / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if not debug:
        from tasks.quiet import quiet_libraries

        quiet_libraries()
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def _setup_flow_run(
    params: Path, debug: bool, command: str, extra_checks=(), starts_services: bool = False
) -> tuple[Config, Path]:
    """Config, the pre-flight checks (all of them, before Prefect starts), Prefect's home folder, and (unless
    --debug) the console filtered, everything kept in `.llmopt/logs/<command>-<time>.log`."""
    config, root = _setup(params, debug)
    from tasks.preflight import preflight

    preflight(config, root, extra_checks, starts_services)
    # Prefect's embedded server needs its home folder to exist before it opens its database there.
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    if not debug:
        from flows.logs import route_logs

        global _log_file
        _log_file = route_logs(root / config.project.workdir, command)
    return config, root


_log_file: Path | None = None  # this command's full log (set once the pre-flight checks passed)


class _user_errors:
    """Context manager: an LlmoptError becomes one red line and its exit code; --debug keeps the traceback."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, LlmoptError) and not self.debug and _log_file is not None:
            from tasks.report.tracking import tracking_unreachable

            story = tracking_unreachable(exc)  # a registry that vanished mid-run is the user's to restart
            if story:
                with _log_file.open("a") as log:  # the full story stays in the log
                    log.write("".join(traceback.format_exception(exc)))
                exc = RegistryError(story)
        if isinstance(exc, LlmoptError) and not self.debug:
            if _log_file is not None:
                console.print(
                    f"[dim]full log: {_log_file} (--debug shows it all here)[/]",
                    highlight=False,
                    soft_wrap=True,
                )
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code)
        return False


def _print_leaderboard(board) -> None:
    from tasks.decide.select import table_cells, table_columns

    table = Table(
        title=f"Leaderboard, objective {board.objective} (ppl budget +{board.max_ppl_increase:.0%} vs {board.baseline} "
        f"at {board.confidence:.0%} confidence; ★ winner, ◆ Pareto frontier, ✗ over budget)"
    )
    for column in table_columns(board):
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    for cells in table_cells(board):
        table.add_row(*cells)
    _wide_console().print(table)


def _print_spread(spread) -> None:
    table = Table(title="Repeatability: median over trials ± half the spread (max − min) / median")
    table.add_column("variant", no_wrap=True)
    metrics = list(dict.fromkeys(row.metric for row in spread))
    for metric in metrics:
        table.add_column(metric, justify="right", no_wrap=True)
    for variant in dict.fromkeys(row.variant for row in spread):
        cells = {row.metric: row.summary for row in spread if row.variant == variant}
        table.add_row(variant, *[cells[m] for m in metrics])
    _wide_console().print(table)


def _print_comparison(previous: dict, spread) -> None:
    """Batch-1 decode speed now vs the compared run (same fingerprint), per variant present in both."""
    import statistics

    table = Table(title="Against the compared run (same machine fingerprint): batch-1 decode tok/s")
    for column in ("variant", "before", "now", "change", "spread now"):
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    for row in spread:
        trials = previous["trials"].get(row.variant)
        if row.metric != "decode tok/s bs1" or not trials:
            continue
        before = statistics.median(trial["decode_tok_s"] for trial in trials)
        table.add_row(
            row.variant,
            f"{before:.1f}",
            f"{row.median:.1f}",
            f"{row.median / before - 1:+.1%}",
            f"{row.spread:.1%}",
        )
    _wide_console().print(table)


def _wide_console() -> Console:
    out = Console()
    out.width = max(out.width, 200)  # piped output (CI logs, DVC) defaults to 80 columns, too narrow here
    return out


if __name__ == "__main__":
    main()

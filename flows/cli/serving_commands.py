"""Commands around the server: serve registered models, and drive a running server with a load test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.app import DebugOption, ParamsOption, app
from flows.cli.render import print_load_test, print_peer_comparison
from flows.cli.session import CommandSession, console
from tasks.errors import ConfigError


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
    with CommandSession(debug) as session:
        config, root = session.setup(params)
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
    rates: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated request rates in req/s, Poisson arrivals, e.g. 0.5,1,2 (default: loadtest.rates)."
        ),
    ] = None,
    peer: Annotated[
        list[str] | None,
        typer.Option(
            help="Another OpenAI-compatible server to drive with the same requests, as URL[=LABEL] (repeatable): "
            "one table, llmopt first, with each server's ratio to it (llama-server, vLLM: docs/serving.md)."
        ),
    ] = None,
    repeats: Annotated[
        int,
        typer.Option(min=1, help="With --peer: rounds, the servers interleaved; ratios with their spread."),
    ] = 1,
    ignore_eos: Annotated[
        bool, typer.Option(help="Every answer runs to its max_tokens (the same work on every server).")
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Drive a running `llmopt serve` at each concurrency level (closed loop) and request rate (open loop, Poisson
    arrivals) with the same seeded requests (evaluation-split prompts of varied length, varied max_tokens, greedy,
    streamed); print requests/s, aggregate tok/s, TTFT, time per output token, inter-token latency and end-to-end
    p50/p95, and log them to MLflow beside the model version served, with the engine's offline batch throughput
    from the pipeline's benchmark as the reference ceiling. With `slo` set, each level's goodput (requests/s
    that met the SLO) and a search for the highest request rate that meets it."""
    with CommandSession(debug) as session:
        config, root = session.setup(params)
        from serving.loadtest import load_test, log_load_test, offline_ceiling, search_rate, served_model
        from tasks.inputs.data import read_split
        from tasks.measure.served import request_set
        from tasks.report.tracking import configure_tracking

        cfg = config.loadtest.model_copy(
            update={k: v for k, v in {"requests_per_level": requests}.items() if v is not None}
        )
        levels = _levels(concurrency) if concurrency else cfg.concurrency
        offered = _rates(rates) if rates else cfg.rates
        base = url or f"http://{config.serve.host}:{config.serve.port}"
        api_key = os.environ.get(config.serve.api_key_env) or None
        entry = served_model(base, model, api_key)
        data = root / config.project.workdir / "data"
        if not (data / "evaluation.jsonl").is_file():
            raise ConfigError(
                f"{data}: no prepared evaluation split to draw prompts from; run `llmopt run` first"
            )
        passages = read_split(data, "evaluation")
        batch = request_set(passages, cfg, config.serve.max_new_tokens)
        if peer:
            from serving.peers import Server

            servers = [Server("llmopt", base, entry["id"], api_key), *_peers(peer)]
            _compare_peers(config, root, cfg, entry, servers, passages, levels, repeats, ignore_eos)
            return
        console.print(
            f"load test: {entry['served_id']} ({entry['variant']}) at {base}, levels {levels}, {len(batch)} requests each"
        )
        results = load_test(base, entry["id"], batch, levels, api_key, offered, config.slo, cfg.seed)
        best, trials = None, []
        if config.slo and cfg.search_trials:
            one_client = [r.requests_s for r in results if r.concurrency == 1 and r.requests_s > 0]
            start = one_client[0] if one_client else 1.0
            console.print(
                f"searching the highest rate meeting the SLO, from {start:.2g} req/s ({cfg.search_trials} trials)"
            )

            def report(result: Any, met: bool) -> None:
                verdict = "meets" if met else "misses"
                console.print(
                    f"  {result.rate_rps:.3g} req/s: TTFT p95 {result.ttft_p95_ms:.0f} ms, TPOT p95 "
                    f"{result.tpot_p95_ms:.0f} ms, {result.errors} errors: {verdict} the SLO"
                )

            best, trials = search_rate(
                base, entry["id"], batch, api_key, config.slo, start, cfg.search_trials, cfg.seed, report
            )
            results = results + sorted(trials, key=lambda r: r.rate_rps)
        configure_tracking(config.tracking, root)
        registered, _, version = entry["served_id"].rpartition("/")
        ceiling = offline_ceiling(registered, version)
        same_mix = None
        if cfg.offline_ceiling:
            console.print(
                "the same requests offline through the same engine (the served version, in this process) …"
            )
            same_mix = _same_mix(config, registered, version, batch, sorted({1, max(levels)}))
        settings = {
            "url": base,
            "levels": levels,
            "rates": offered,
            **cfg.model_dump(exclude={"concurrency", "rates"}),
            "slo": config.slo.model_dump() if config.slo else None,
        }
        run_id = log_load_test(
            config.tracking.experiment, entry, results, ceiling, settings, best, trials, same_mix
        )
        print_load_test(results, ceiling, config.slo, best, same_mix)
        console.print(f"logged to MLflow run {run_id} (tag llmopt.loadtest_run on {registered} v{version})")


def _peers(texts: list[str]) -> list:
    from serving.peers import Server, first_model, parse_peer

    servers = []
    for text in texts:
        try:
            url, label = parse_peer(text)
            servers.append(Server(label, url, first_model(url)))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return servers


def _compare_peers(
    config: Any,
    root: Path,
    cfg: Any,
    entry: dict,
    servers: list,
    passages: list[str],
    levels: list[int],
    repeats: int,
    ignore_eos: bool,
) -> None:
    """The same requests against llmopt and every peer (serving/peers.py); one table, logged to MLflow."""
    from serving.peers import compare, log_peer_comparison
    from tasks.measure.served import request_set
    from tasks.report.tracking import configure_tracking

    def requests_for(repeat: int, level: int) -> list:
        seeded = cfg.model_copy(update={"seed": cfg.seed + 1 + 1009 * (repeat + 1) + level})  # -1: warm-up
        return request_set(passages, seeded, config.serve.max_new_tokens)

    def progress(repeat: int, label: str, result: Any) -> None:
        console.print(
            f"  repeat {repeat + 1}/{repeats}, {result.concurrency} clients, {label}: {result.tok_s:.0f} tok/s, "
            f"TTFT p50/p95 {result.ttft_p50_ms:.0f}/{result.ttft_p95_ms:.0f} ms, {result.errors} errors"
        )

    names = ", ".join(f"{s.label} ({s.url})" for s in servers)
    console.print(
        f"load test against peers: {names}; levels {levels}, {cfg.requests_per_level} requests each"
    )
    table = compare(servers, requests_for, levels, repeats, ignore_eos, progress)
    configure_tracking(config.tracking, root)
    settings = {"levels": levels, "repeats": repeats, "ignore_eos": ignore_eos, **cfg.model_dump()}
    run_id = log_peer_comparison(config.tracking.experiment, entry, servers, table, settings)
    print_peer_comparison(table, repeats)
    console.print(f"logged to MLflow run {run_id}")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency: comma-separated positive integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency: comma-separated positive integers, got {text!r}")
    return levels


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--rates: comma-separated positive numbers (req/s), got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise ConfigError(f"--rates: comma-separated positive numbers (req/s), got {text!r}")
    return rates


def _same_mix(
    config: Any, registered: str, version: str, batch: list, clients: list[int]
) -> dict[int, float]:
    """tok/s of `batch` run offline through the served version, loaded as the server loads it (downloaded,
    verified, warmed up), with the server's batching settings, for each number of clients."""
    from serving.loadtest import offline_same_mix
    from serving.models import Limits, load_version

    serve, target = config.serve, config.target
    limits = Limits.of(serve)
    loaded = load_version(
        registered, version, target.threads, limits, None, target.device, target.tensor_parallel
    )
    try:
        return {count: offline_same_mix(loaded.runtime, batch, count, limits) for count in clients}
    finally:
        loaded.scheduler.close()
        getattr(loaded.runtime, "close", lambda: None)()  # a split model's other ranks
        loaded.keep.cleanup()

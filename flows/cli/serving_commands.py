"""Commands around the server: serve registered models, and drive a running server with a load test."""

from __future__ import annotations

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
    prompt_words: Annotated[
        str | None,
        typer.Option(
            help="Prompt length in words, N or LOW,HIGH (default: loadtest.prompt_words; 96 is ~128 tokens)."
        ),
    ] = None,
    max_tokens: Annotated[
        str | None,
        typer.Option(help="Answer budget in tokens, N or LOW,HIGH (default: loadtest.max_tokens)."),
    ] = None,
    prompt_start: Annotated[
        str | None,
        typer.Option(
            help="Where a prompt starts in its passage: first (prompts of a passage share a start, as chats sharing "
            "a system prompt do) or anywhere (no shared prefixes) (default: loadtest.prompt_start)."
        ),
    ] = None,
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
        config = _with_mix(config, prompt_words, max_tokens, prompt_start)
        from serving.loadtest_run import LoadtestOutcome, LoadtestPlan, run_loadtest

        plan = LoadtestPlan(
            url=url,
            model=model,
            levels=_levels(concurrency) if concurrency else None,
            rates=_rates(rates) if rates else None,
            requests=requests,
            peers=tuple(peer or ()),
            repeats=repeats,
            ignore_eos=ignore_eos,
        )
        outcome = run_loadtest(config, root, plan, console.print)
        if isinstance(outcome, LoadtestOutcome):
            print_load_test(outcome.results, outcome.ceiling, config.slo, outcome.best, outcome.same_mix)
            console.print(
                f"logged to MLflow run {outcome.run_id} (tag llmopt.loadtest_run on {outcome.registered} "
                f"v{outcome.version})"
            )
        else:
            print_peer_comparison(outcome.table, outcome.repeats)
            console.print(f"logged to MLflow run {outcome.run_id}")


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


def _with_mix(config: Any, words: str | None, tokens: str | None, start: str | None) -> Any:
    """`config` with the request mix the options name in place of `loadtest`'s (each one left unset keeps its own)."""
    update: dict[str, Any] = {}
    if words:
        update["prompt_words"] = _span(words, "--prompt-words")
    if tokens:
        update["max_tokens"] = _span(tokens, "--max-tokens")
    if start:
        if start not in ("first", "anywhere"):
            raise ConfigError(f"--prompt-start: first or anywhere, got {start!r}")
        update["prompt_start"] = start
    if not update:
        return config
    return config.model_copy(update={"loadtest": config.loadtest.model_copy(update=update)})


def _span(text: str, flag: str) -> list[int]:
    """N or LOW,HIGH (positive integers, LOW <= HIGH) as [low, high]."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 1 or values[0] > values[1]:
        raise ConfigError(f"{flag}: a positive integer N or LOW,HIGH with LOW <= HIGH, got {text!r}")
    return values

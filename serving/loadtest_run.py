"""What `llmopt loadtest` does, apart from its command line: find the served model, draw the requests from the
prepared evaluation split, drive the server level by level (and search the highest rate meeting the SLO), replay
the same requests offline through the served version, log it all to MLflow beside that version; or, with peers,
drive every server with the same requests (serving/peers.py). The command parses its options and renders what
comes back (flows/cli/serving_commands.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.loadtest import LevelResult
from tasks.errors import ConfigError
from tasks.params import Config


@dataclass(frozen=True)
class LoadtestPlan:
    """The command's choices, each None or empty where params.yaml's `loadtest` section decides."""

    url: str | None = None
    model: str | None = None
    levels: list[int] | None = None
    rates: list[float] | None = None
    requests: int | None = None
    peers: tuple[str, ...] = ()
    repeats: int = 1
    ignore_eos: bool = False


@dataclass(frozen=True)
class LoadtestOutcome:
    """One server's load test, as logged (`run_id`) beside `registered` v`version`."""

    results: list[LevelResult]
    ceiling: tuple[int, float] | None
    best: LevelResult | None
    same_mix: dict[int, float] | None
    run_id: str
    registered: str
    version: str


@dataclass(frozen=True)
class PeerOutcome:
    table: list[Any]  # serving.peers.PeerRow, llmopt's rows first
    repeats: int
    run_id: str


def run_loadtest(
    config: Config, root: Path, plan: LoadtestPlan, say: Callable[[str], None]
) -> LoadtestOutcome | PeerOutcome:
    """Drive the server `plan` names (see the module docstring); `say` gets one line per thing worth telling."""
    from serving.loadtest import load_test, log_load_test, offline_ceiling, served_model
    from tasks.measure.served import prompt_passages, request_set
    from tasks.report.tracking import configure_tracking

    updates = {"requests_per_level": plan.requests} if plan.requests is not None else {}
    cfg = config.loadtest.model_copy(update=updates)
    levels = plan.levels or cfg.concurrency
    offered = plan.rates or cfg.rates
    base = plan.url or f"http://{config.serve.host}:{config.serve.port}"
    api_key = os.environ.get(config.serve.api_key_env) or None
    entry = served_model(base, plan.model, api_key)
    data = root / config.project.workdir / "data"
    if not (data / "evaluation.jsonl").is_file():
        raise ConfigError(
            f"{data}: no prepared evaluation split to draw prompts from; run `llmopt run` first"
        )
    passages = prompt_passages(config, data)
    if plan.peers:
        from serving.peers import Server

        servers = [Server("llmopt", base, entry["id"], api_key), *_peers(plan.peers)]
        return _compare_peers(config, root, cfg, entry, servers, passages, levels, plan, say)
    batch = request_set(passages, cfg, config.serve.max_new_tokens)
    say(
        f"load test: {entry['served_id']} ({entry['variant']}) at {base}, levels {levels}, {len(batch)} requests each"
    )
    results = load_test(base, entry["id"], batch, levels, api_key, offered, config.slo, cfg.seed)
    best, trials = _search(config, cfg, base, entry, batch, api_key, results, say)
    results = results + sorted(trials, key=lambda r: r.rate_rps)
    configure_tracking(config.tracking, root)
    registered, _, version = entry["served_id"].rpartition("/")
    ceiling = offline_ceiling(registered, version)
    same_mix = None
    if cfg.offline_ceiling:
        say("the same requests offline through the same engine (the served version, in this process) …")
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
    return LoadtestOutcome(results, ceiling, best, same_mix, run_id, registered, version)


def _search(
    config: Config,
    cfg: Any,
    base: str,
    entry: dict,
    batch: list,
    api_key: str | None,
    results: list[LevelResult],
    say: Callable[[str], None],
) -> tuple[LevelResult | None, list[LevelResult]]:
    """With an SLO and `search_trials`: the highest request rate meeting it, from the one-client rate (the best
    trial and every trial); else nothing."""
    from serving.loadtest import search_rate

    if not (config.slo and cfg.search_trials):
        return None, []
    one_client = [r.requests_s for r in results if r.concurrency == 1 and r.requests_s > 0]
    start = one_client[0] if one_client else 1.0
    say(f"searching the highest rate meeting the SLO, from {start:.2g} req/s ({cfg.search_trials} trials)")

    def report(result: Any, met: bool) -> None:
        verdict = "meets" if met else "misses"
        say(
            f"  {result.rate_rps:.3g} req/s: TTFT p95 {result.ttft_p95_ms:.0f} ms, TPOT p95 "
            f"{result.tpot_p95_ms:.0f} ms, {result.errors} errors: {verdict} the SLO"
        )

    best, trials = search_rate(
        base, entry["id"], batch, api_key, config.slo, start, cfg.search_trials, cfg.seed, report
    )
    return best, list(trials)


def _peers(texts: tuple[str, ...]) -> list:
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
    config: Config,
    root: Path,
    cfg: Any,
    entry: dict,
    servers: list,
    passages: list[str],
    levels: list[int],
    plan: LoadtestPlan,
    say: Callable[[str], None],
) -> PeerOutcome:
    """The same requests against llmopt and every peer (serving/peers.py); one table, logged to MLflow."""
    from serving.peers import compare, log_peer_comparison
    from tasks.measure.served import request_set
    from tasks.report.tracking import configure_tracking

    def requests_for(repeat: int, level: int) -> list:
        seeded = cfg.model_copy(update={"seed": cfg.seed + 1 + 1009 * (repeat + 1) + level})  # -1: warm-up
        return request_set(passages, seeded, config.serve.max_new_tokens)

    def progress(repeat: int, label: str, result: Any) -> None:
        say(
            f"  repeat {repeat + 1}/{plan.repeats}, {result.concurrency} clients, {label}: {result.tok_s:.0f} "
            f"tok/s, TTFT p50/p95 {result.ttft_p50_ms:.0f}/{result.ttft_p95_ms:.0f} ms, {result.errors} errors"
        )

    names = ", ".join(f"{s.label} ({s.url})" for s in servers)
    say(f"load test against peers: {names}; levels {levels}, {cfg.requests_per_level} requests each")
    table = compare(servers, requests_for, levels, plan.repeats, plan.ignore_eos, progress)
    configure_tracking(config.tracking, root)
    settings = {"levels": levels, "repeats": plan.repeats, "ignore_eos": plan.ignore_eos, **cfg.model_dump()}
    run_id = log_peer_comparison(config.tracking.experiment, entry, servers, table, settings)
    return PeerOutcome(table, plan.repeats, run_id)


def _same_mix(
    config: Config, registered: str, version: str, batch: list, clients: list[int]
) -> dict[int, float]:
    """tok/s of `batch` run offline through the served version, loaded as the server loads it (downloaded,
    verified, warmed up), with the server's batching settings, for each number of clients."""
    from serving.loadtest import offline_same_mix
    from serving.models import Limits, load_version

    limits = Limits.of(config.serve)
    loaded = load_version(registered, version, config.target, limits, None)
    try:
        return {count: offline_same_mix(loaded.runtime, batch, count, limits) for count in clients}
    finally:
        loaded.scheduler.close()
        getattr(loaded.runtime, "close", lambda: None)()  # a split model's other ranks
        loaded.keep.cleanup()

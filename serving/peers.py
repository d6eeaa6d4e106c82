"""`llmopt loadtest --peer`: the same requests against llmopt's server and other OpenAI-compatible servers (the
engines' own: llama.cpp's llama-server, vLLM), level by level, the servers interleaved, each repeat and level with
requests of its own (peer servers keep prompt caches across requests: a replayed prompt would be served from its
cache), and each server's throughput and time to first token as a ratio to llmopt's in the same repeat."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from serving.loadtest import LevelResult, LoadRequest, run_level, summarize


@dataclass(frozen=True)
class Server:
    label: str
    url: str
    model: str | None  # as the server names it (None: its only one)
    api_key: str | None = None


@dataclass(frozen=True)
class PeerRow:
    """One server at one level over every repeat: medians, and ratios to llmopt's figure of the same repeat."""

    label: str
    concurrency: int
    tok_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    errors: int
    tok_s_ratio: tuple[float, float, float]  # median, lowest, highest (llmopt's own row: 1, 1, 1)
    ttft_p95_ratio: tuple[float, float, float]


def parse_peer(text: str) -> tuple[str, str]:
    """`URL[=LABEL]` -> (url, label); the label defaults to the URL's host and port."""
    url, _, label = text.partition("=")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer: URL[=LABEL] with an http(s) URL, got {text!r}")
    return url.rstrip("/"), label or url.split("://", 1)[1].rstrip("/")


def first_model(url: str) -> str | None:
    """The first model a peer's /v1/models lists (None where it lists none: llama-server answers any name)."""
    try:
        listed = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"no OpenAI-compatible server answers at {url}/v1/models ({exc})") from None
    return listed[0]["id"] if listed else None


def compare(
    servers: list[Server],
    requests_for: Callable[[int, int], list[LoadRequest]],
    levels: list[int],
    repeats: int,
    ignore_eos: bool,
    progress: Callable[[int, str, LevelResult], None] | None = None,
) -> list[PeerRow]:
    """Drive every server at every level `repeats` times; `requests_for(repeat, level)` gives that round's
    requests, the same for every server. The servers' order rotates each repeat (none always goes first)."""
    warm = requests_for(-1, 1)[:1]
    for server in servers:  # a first request pays for allocations, on every server
        asyncio.run(
            run_level(server.url, server.model, warm, 1, server.api_key, ignore_eos, keep_alive=False)
        )
    measured: dict[tuple[str, int], list[LevelResult]] = {}
    for repeat in range(repeats):
        order = servers[repeat % len(servers) :] + servers[: repeat % len(servers)]
        for level in levels:
            batch = requests_for(repeat, level)
            for server in order:
                drive = run_level(
                    server.url, server.model, batch, level, server.api_key, ignore_eos, keep_alive=False
                )
                outcomes, wall = asyncio.run(drive)
                result = summarize(level, outcomes, wall)
                measured.setdefault((server.label, level), []).append(result)
                if progress:
                    progress(repeat, server.label, result)
    return rows(servers[0].label, [s.label for s in servers], levels, measured)


def rows(
    reference: str, labels: list[str], levels: list[int], measured: dict[tuple[str, int], list[LevelResult]]
) -> list[PeerRow]:
    """Per level and server: median figures over the repeats, and per repeat the ratio to `reference`'s."""

    def spread(values: list[float]) -> tuple[float, float, float]:
        return statistics.median(values), min(values), max(values)

    table = []
    for level in levels:
        ours = measured[(reference, level)]
        for label in labels:
            theirs = measured[(label, level)]
            table.append(
                PeerRow(
                    label,
                    level,
                    statistics.median(r.tok_s for r in theirs),
                    statistics.median(r.ttft_p50_ms for r in theirs),
                    statistics.median(r.ttft_p95_ms for r in theirs),
                    sum(r.errors for r in theirs),
                    spread([t.tok_s / o.tok_s for t, o in zip(theirs, ours, strict=True)]),
                    spread([t.ttft_p95_ms / o.ttft_p95_ms for t, o in zip(theirs, ours, strict=True)]),
                )
            )
    return table


def log_peer_comparison(
    experiment: str, entry: dict, servers: list[Server], table: list[PeerRow], settings: dict
) -> str:
    """One MLflow run (`llmopt.kind=loadtest_peers`), tagged with the llmopt version driven: per server and
    level, its median figures and its ratios to llmopt's. Returns the run id."""
    from tasks.report.tracking import log_standalone_run

    registered, _, version = entry["served_id"].rpartition("/")
    metrics: dict[str, float] = {}
    for row in table:
        prefix = f"{row.label}.c{row.concurrency}"
        figures = {"tok_s": row.tok_s, "ttft_p50_ms": row.ttft_p50_ms, "ttft_p95_ms": row.ttft_p95_ms}
        for name in ("tok_s_ratio", "ttft_p95_ratio"):  # median, and the lowest and highest repeat
            figures |= dict(zip((name, f"{name}_low", f"{name}_high"), getattr(row, name), strict=True))
        metrics |= {f"{prefix}.{key}": value for key, value in figures.items()}
    tags = {
        "llmopt.kind": "loadtest_peers",
        "llmopt.model": registered,
        "llmopt.model_version": version,
        "llmopt.variant": entry["variant"],
        **{f"llmopt.peer.{s.label}": s.url for s in servers[1:]},
    }
    return log_standalone_run(experiment, f"loadtest peers {entry['served_id']}", tags, settings, metrics)

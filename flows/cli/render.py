"""How the command line shows results: rich tables on the console (wide when piped, so CI logs and DVC keep
every column) and the outcome's last line."""

from __future__ import annotations

import statistics
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from flows.cli.session import console

# Served tok/s above the offline replay of the same requests by more than the noise of two runs on shared cores:
# the replay (no HTTP, no client, the same scheduler) cannot be slower, so the pair is not a measurement
SUSPECT_ABOVE_OFFLINE = 1.05


def print_outcome(outcome, last_line: bool = True) -> None:
    """The leaderboard, the registration, and as the last line what happened to production and why (unless the
    caller ends with it as an error)."""
    print_leaderboard(outcome.leaderboard)
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


def print_load_test(
    results: list,
    ceiling: tuple[int, float] | None,
    slo: Any = None,
    best: Any = None,
    same_mix: dict[int, float] | None = None,
) -> None:
    table = Table(title="Load test (greedy, streamed; latencies in ms)")
    columns = [
        "load",
        "req/s",
        "tok/s",
        "TTFT p50",
        "TTFT p95",
        "TPOT p50",
        "TPOT p95",
        "ITL p95",
        "e2e p95",
        "decode tok/s",
        "prefill",
        "errors",
    ]
    if slo:
        columns.insert(2, "goodput")
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        row = [
            r.load,
            f"{r.requests_s:.2f}",
            f"{r.tok_s:.0f}",
            f"{r.ttft_p50_ms:.0f}",
            f"{r.ttft_p95_ms:.0f}",
            f"{r.tpot_p50_ms:.0f}",
            f"{r.tpot_p95_ms:.0f}",
            f"{r.itl_p95_ms:.0f}",
            f"{r.e2e_p95_ms:.0f}",
            f"{r.decode_tok_s:.0f}",
            f"{r.prefill_share:.0%}",
            str(r.errors),
        ]
        if slo:
            row.insert(2, f"{r.goodput_rps:.2f}")
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 150).print(table)  # piped: do not squeeze to 80
    console.print(
        "load: clients sending back to back, or req/s offered with Poisson arrivals; tok/s: generated tokens of all "
        "requests per second; TPOT: time per output token after the first; ITL: gap between streamed chunks; "
        "decode tok/s: the same inside batched decode steps only; prefill: share of the time the engine spent on "
        "prompts (every running request waits for it)."
    )
    if slo:
        bounds = ", ".join(
            f"{name} ≤ {value:g} ms"
            for name, value in (("TTFT p95", slo.ttft_p95_ms), ("TPOT p95", slo.tpot_p95_ms))
            if value is not None
        )
        if best is not None:
            console.print(
                f"SLO ({bounds}): met up to {best.rate_rps:.3g} req/s offered, goodput {best.goodput_rps:.2f} req/s"
            )
        else:
            console.print(f"SLO ({bounds}): no rate tried met it; goodput per level is in the table")
    for clients, tok_s in sorted((same_mix or {}).items()):
        served = next((r for r in results if r.concurrency == clients), None)
        share = ""
        if served and tok_s and served.tok_s > SUSPECT_ABOVE_OFFLINE * tok_s:
            share = (
                f"; served: {served.tok_s:.0f} tok/s, above it ({served.tok_s / tok_s:.0%}): no ceiling, so one of "
                "the two measurements is suspect (the machine's load changed between them?); rerun both"
            )
        elif served and tok_s:
            share = f"; served: {served.tok_s:.0f} tok/s, {served.tok_s / tok_s:.0%} of it"
        console.print(
            f"offline, same requests, same engine, {clients} client{'s' if clients != 1 else ''}: "
            f"{tok_s:.0f} tok/s{share}"
        )
    top = max((r for r in results if r.concurrency), key=lambda r: r.concurrency, default=None)
    if ceiling and top is not None:
        console.print(
            f"offline ceiling (pipeline benchmark, decode only, batch {ceiling[0]}): {ceiling[1]:.0f} tok/s; at "
            f"{top.concurrency} clients the server decodes at {top.decode_tok_s / ceiling[1]:.0%} of it and "
            f"delivers {top.tok_s / ceiling[1]:.0%} of it end to end"
        )


def print_history(project: str, moves) -> None:
    """Every decision about production, oldest first."""
    table = Table(title=f"{project}: production history")
    for column in ("time (UTC)", "by", "kind", "from", "to", "moved", "reason"):
        table.add_column(column, overflow="fold")
    for move in moves:
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


def print_leaderboard(board) -> None:
    from tasks.decide.leaderboard_table import table_cells, table_columns

    table = Table(
        title=f"Leaderboard, objective {board.objective} (ppl budget +{board.max_ppl_increase:.0%} vs {board.baseline} "
        f"at {board.confidence:.0%} confidence; {board.legend()})"
    )
    rows = table_cells(board)
    for column in table_columns(board):
        # the variant's name never shortened (a wide table squeezes the figures' columns instead)
        name = column == "variant"
        width = max((len(cells[0]) for cells in rows), default=None) if name else None
        table.add_column(column, justify="left" if name else "right", no_wrap=True, min_width=width)
    for cells in rows:
        table.add_row(*cells)
    _wide_console().print(table)


def print_spread(spread) -> None:
    table = Table(title="Repeatability: median over trials ± half the spread (max − min) / median")
    table.add_column("variant", no_wrap=True)
    metrics = list(dict.fromkeys(row.metric for row in spread))
    for metric in metrics:
        table.add_column(metric, justify="right", no_wrap=True)
    for variant in dict.fromkeys(row.variant for row in spread):
        cells = {row.metric: row.summary for row in spread if row.variant == variant}
        table.add_row(variant, *[cells[m] for m in metrics])
    _wide_console().print(table)


def print_comparison(previous: dict, spread) -> None:
    """Batch-1 decode speed now vs the compared run (same fingerprint), per variant present in both."""
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


def print_peer_comparison(table: list, repeats: int) -> None:
    """The peer table (serving/peers.py): per level, llmopt first, each server's medians and its ratios to llmopt."""
    spread = repeats > 1
    view = Table(
        title=f"Served against peers (medians of {repeats} repeat{'s' if spread else ''}; ratios to llmopt)"
    )
    for column in (
        "load",
        "server",
        "tok/s",
        "TTFT p50",
        "TTFT p95",
        "tok/s ÷ llmopt",
        "TTFT p95 ÷ llmopt",
        "errors",
    ):
        view.add_column(column, justify="left" if column in ("load", "server") else "right")

    def ratio(values: tuple[float, float, float]) -> str:
        return f"{values[0]:.2f} ({values[1]:.2f}–{values[2]:.2f})" if spread else f"{values[0]:.2f}"

    for row in table:
        view.add_row(
            f"{row.concurrency} client{'s' if row.concurrency != 1 else ''}",
            row.label,
            f"{row.tok_s:.0f}",
            f"{row.ttft_p50_ms:.0f}",
            f"{row.ttft_p95_ms:.0f}",
            ratio(row.tok_s_ratio),
            ratio(row.ttft_p95_ratio),
            str(row.errors),
        )
    _wide_console().print(view)
    console.print(
        "ratios per repeat against llmopt's figure of the same repeat (median, lowest–highest): above 1 in tok/s "
        "and below 1 in TTFT p95, the peer does better"
    )


def print_search(report) -> None:
    """Every trial of a search (the stage it reached, its proxies and last looks, why it stopped), the notes, the
    winner's `variants:` block, and the summary line."""
    table = Table(title=f"search against {report.leader}")
    for column in ("candidate", "stage", "KL", "proxy tok/s", "speed × leader (CI)", "ppl ×", "why"):
        table.add_column(column, overflow="fold")
    for name, trial in report.outcome.trials.items():
        last = trial.looks[-1] if trial.looks else None
        speed = last.speed if last else None
        accuracy = last.accuracy if last else None
        table.add_row(
            name,
            trial.stage,
            f"{trial.proxy.kl:.3g}" if trial.proxy else "–",
            f"{trial.proxy.decode_tok_s:.1f}" if trial.proxy else "–",
            f"{speed.ratio:.3f} ({speed.low:.3f}–{speed.high:.3f})" if speed else "–",
            f"{accuracy.ratio:.3f}" if accuracy else "–",
            trial.reason,
        )
    _wide_console().print(table)
    for note in report.notes:
        console.print(f"note: {note}", soft_wrap=True, highlight=False, markup=False)
    for path in report.files:
        console.print(f"wrote {path}", soft_wrap=True, highlight=False, markup=False)
    if report.winner_block:
        console.print("The winner, as params.yaml's `variants:` entry (keep it to measure it in every run):")
        console.print(report.winner_block, soft_wrap=True, highlight=False, markup=False)
    console.print(report.summary(), soft_wrap=True, highlight=False, markup=False)
    if (reg := report.registration) is not None:
        reused = " (same bytes as before, reused)" if reg.reused else ""
        console.print(
            f"Registered {reg.name} version {reg.version}{reused} → alias candidate", soft_wrap=True
        )

"""The run report: baseline vs the production champion vs this run's challenger, the gate's verdict in words, the
leaderboard, the Pareto plot and where the time went. One self-contained HTML file (plots inlined) and the same
in markdown, written beside the leaderboard and logged to the parent MLflow run."""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path

from tasks.decide.gate import Verdict
from tasks.decide.leaderboard_table import table_cells, table_columns
from tasks.decide.select import Leaderboard, LeaderboardRow

HTML_FILE, MARKDOWN_FILE = "report.html", "report.md"


@dataclass(frozen=True)
class ReportContext:
    """What the leaderboard does not know: who is who, what was decided, the machine and the time spent."""

    project: str
    started: str  # UTC, ISO 8601
    champion: tuple[str, str] | None  # (production version, the leaderboard name it was measured under)
    verdict: Verdict
    promoted: bool
    version: str | None  # the judged (registered) version, if any
    fingerprint: dict
    timing: str  # where the run's time went (StageClock.line)
    plots: list[Path]  # PNG files, inlined in the HTML


def _fmt(value: float, digits: int = 1) -> str:
    return (
        "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"
    )


def comparison(board: Leaderboard, ctx: ReportContext) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(column headers, rows of (measure, one cell per model)) for baseline, production and challenger."""
    models: list[tuple[str, LeaderboardRow]] = [(f"baseline ({board.baseline})", board.row(board.baseline))]
    names = {r.score.variant for r in board.rows}
    if ctx.champion and ctx.champion[1] in names:
        models.append((f"production v{ctx.champion[0]} ({ctx.champion[1]})", board.row(ctx.champion[1])))
    winner = board.winner
    if winner and winner not in {row.score.variant for _, row in models}:
        models.append((f"challenger ({winner})", board.row(winner)))
    batch_sizes = sorted({b for _, row in models for b, _ in row.score.batch_decode_tok_s})

    def speed_at(row: LeaderboardRow, batch: int) -> str:
        return _fmt(dict(row.score.batch_decode_tok_s).get(batch, float("nan")))

    measures: list[tuple[str, list[str]]] = [
        ("decode tok/s, batch 1", [_fmt(r.score.decode_tok_s) for _, r in models]),
        ("speedup vs baseline", [f"×{r.speedup:.2f}" for _, r in models]),
        ("time to first token, ms", [_fmt(r.score.ttft_ms) for _, r in models]),
        ("per-token latency, ms", [_fmt(1000 / r.score.decode_tok_s, 2) for _, r in models]),
        ("request latency p95, ms", [_fmt(r.score.latency_p95_ms) for _, r in models]),
        *(
            (f"throughput tok/s, batch {b}", [speed_at(r, b) for _, r in models])
            for b in batch_sizes
            if b != 1
        ),
        ("peak RSS, MB", [_fmt(r.score.peak_rss_mb, 0) for _, r in models]),
        ("size on disk, MB", [_fmt(r.score.size_bytes / 1e6) for _, r in models]),
        ("perplexity", [_fmt(r.score.perplexity, 3) for _, r in models]),
        (
            f"perplexity × baseline ({board.confidence:.0%} CI)",
            [f"{r.ppl_ratio:.3f} ({r.ppl_ratio_low:.3f}–{r.ppl_ratio_high:.3f})" for _, r in models],
        ),
        ("cloze accuracy", [f"{r.score.cloze_accuracy:.1%}" for _, r in models]),
        ("within the accuracy budget", ["yes" if r.within_budget else "no" for _, r in models]),
    ]
    return ["measure", *(label for label, _ in models)], measures


def verdict_in_words(board: Leaderboard, ctx: ReportContext) -> list[str]:
    """The decision as sentences: what happened to production, why, and the evidence against the thresholds."""
    v = ctx.verdict
    if ctx.promoted:
        lines = [f"Production moved to v{ctx.version}: {v.reason}."]
    else:
        lines = [f"Production unchanged: {v.reason}."]
    e = v.evidence
    if "speed_ratio_ci" in e:
        low, high = e["speed_ratio_ci"]
        lines.append(
            f"Speed on the {e['objective']} objective: the challenger runs ×{e['speed_ratio']:.2f} the production "
            f"version ({e['confidence']:.0%} interval {low:.2f}–{high:.2f}); promotion needs the lower bound above "
            f"{e['speed_threshold']:.2f}."
        )
    if "ppl_ratio_vs_champion_ci" in e:
        low, high = e["ppl_ratio_vs_champion_ci"]
        lines.append(
            f"Accuracy against production, paired on the same windows: perplexity ×{e['ppl_ratio_vs_champion']:.3f} "
            f"(interval {low:.3f}–{high:.3f}); cloze {e['cloze_delta_vs_champion']:+.1%} "
            f"(McNemar p {e['cloze_p_vs_champion']:.3f})."
        )
    elif e.get("paired_accuracy") is False:
        lines.append(
            "Production was built on another tokenizer: accuracy is held to this run's baseline budget only."
        )
    if board.winner:
        row = board.row(board.winner)
        lines.append(
            f"Against the baseline, {board.winner} is ×{row.speedup:.2f} as fast with perplexity ×{row.ppl_ratio:.3f} "
            f"(upper bound {row.ppl_ratio_high:.3f} vs the +{board.max_ppl_increase:.0%} budget)."
        )
    slower = [r.score.variant for r in board.rows if r.speedup < 1 and r.score.variant != board.baseline]
    if slower:
        lines.append(f"No speedup on this machine: {', '.join(slower)} (slower than the baseline).")
    return lines


def _machine(fp: dict) -> str:
    packages = ", ".join(f"{name} {version}" for name, version in fp.get("packages", {}).items())
    return (
        f"{fp.get('host', 'this machine')}: {fp.get('cpu_model')} ({fp.get('cpu_cores')} cores, {fp.get('threads')} threads used, "
        f"{fp.get('memory_gib')} GiB), {fp.get('os')}; {packages}; git {fp.get('git_commit')}; "
        f"fingerprint {fp.get('hash')}"
    )


def to_markdown(board: Leaderboard, ctx: ReportContext) -> str:
    """The report as markdown (plots linked as files beside it)."""
    header, rows = comparison(board, ctx)
    lines = [
        f"# llmopt run report — {ctx.project}",
        "",
        f"{ctx.started} · objective **{board.objective}**",
        "",
    ]
    lines += ["## Decision", "", *verdict_in_words(board, ctx), ""]
    lines += ["## Baseline, production and challenger", "", "| " + " | ".join(header) + " |"]
    lines += ["|" + "---|" * len(header)]
    lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
    lines += ["", "## Every variant", "", board.to_markdown().rstrip(), ""]
    lines += [f"![{p.stem}]({p.name})" for p in ctx.plots]
    lines += ["", "## Machine and time", "", _machine(ctx.fingerprint), "", ctx.timing, ""]
    return "\n".join(lines)


_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222 }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right }
th:first-child, td:first-child { text-align: left }
thead th { background: #f3f3f3 }
.passed { border-left: 6px solid #2a7; padding-left: 1em } .refused { border-left: 6px solid #c73; padding-left: 1em }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0 } .muted { color: #666 }
"""


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def to_html(board: Leaderboard, ctx: ReportContext) -> str:
    """The report as one self-contained HTML page (plots inlined as data URIs)."""
    header, rows = comparison(board, ctx)
    decision = "".join(f"<p>{html.escape(line)}</p>" for line in verdict_in_words(board, ctx))
    images = "".join(
        f'<img alt="{html.escape(p.stem)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for p in ctx.plots
        if p.is_file()
    )
    every = _html_table(table_columns(board), table_cells(board))
    if board.failed:
        items = "".join(
            f"<li><b>{html.escape(n)}</b>: {html.escape(w)}</li>" for n, w in sorted(board.failed.items())
        )
        every += f"<p>Failed, left out of the ranking (the run went on without them):</p><ul>{items}</ul>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmopt — {html.escape(ctx.project)}</title>
<style>{_STYLE}</style></head><body>
<h1>llmopt run report — {html.escape(ctx.project)}</h1>
<p class="muted">{html.escape(ctx.started)} · objective <b>{html.escape(board.objective)}</b></p>
<h2>Decision</h2><div class="{"passed" if ctx.promoted else "refused"}">{decision}</div>
<h2>Baseline, production and challenger</h2>
{_html_table(header, [[name, *cells] for name, cells in rows])}
<h2>Every variant</h2>{every}
<p class="muted">{html.escape(board.legend())}.
{html.escape(board.reason)}</p>
{images}
<h2>Machine and time</h2><p>{html.escape(_machine(ctx.fingerprint))}</p><p>{html.escape(ctx.timing)}</p>
</body></html>
"""


def write_run_report(board: Leaderboard, ctx: ReportContext, folder: Path) -> list[Path]:
    """report.html (self-contained) and report.md in `folder`; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HTML_FILE).write_text(to_html(board, ctx))
    (folder / MARKDOWN_FILE).write_text(to_markdown(board, ctx))
    return [folder / HTML_FILE, folder / MARKDOWN_FILE]

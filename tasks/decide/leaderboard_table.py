"""The leaderboard as a table: its columns (those measured) and every row's formatted cells, shared by the
terminal, the markdown and CSV files and the HTML report."""

from __future__ import annotations

from typing import Any

from tasks.decide.long_context import (
    length_cell,
    longest_measured,
    longest_retrieval,
    longest_speed,
    retrieval_cell,
    speed_cell,
)

# tasks/decide/select.py's Leaderboard and VariantScore (which render themselves with these: not imported here)
Leaderboard = VariantScore = Any

NOT_MEASURED = "–"  # a cell the row's (short) benchmark did not measure comparably


def served_top(board: Leaderboard) -> int | None:
    """The most clients any row's served capacity was measured at (None: no row has it)."""
    return max((level.concurrency for r in board.rows for level in r.score.served), default=None)


def capacity_lengths(board: Leaderboard) -> list[int]:
    """The window lengths any row's served capacity by length was measured at, ascending (empty: none)."""
    return sorted({c.length for r in board.rows for c in r.score.served_by_length})


def _kilo(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _capacity_cell(score: VariantScore, lengths: list[int]) -> str:
    """The largest burst meeting the SLO at each length: `4·2·1·0`."""
    clients = {c.length: c.clients for c in score.served_by_length}
    return (
        "·".join(str(clients[n]) if n in clients else NOT_MEASURED for n in lengths)
        if clients
        else NOT_MEASURED
    )


def table_columns(board: Leaderboard) -> list[str]:
    """Column headers; the batched-speed column names the largest measured batch size, the served columns (where
    any row has them) the most clients."""
    top = max((r.score.top_batch()[0] for r in board.rows), default=1)
    clients = served_top(board)
    served = [] if clients is None else [f"c{clients} tok/s", f"c{clients} TTFT p95"]
    lengths = capacity_lengths(board)
    served += [f"clients in SLO @{'·'.join(map(_kilo, lengths))}"] if lengths else []
    longest, facts, prompt = (
        longest_measured(board.rows),
        longest_retrieval(board.rows),
        longest_speed(board.rows),
    )
    return [
        "variant",
        "perplexity",
        "ppl × (CI)",
        *([] if longest is None else [f"ppl@{longest} × (CI)"]),
        *([] if facts is None else [f"facts@{facts} (by depth %)"]),
        "agree %",
        "cloze (p)",
        "tok/s bs1",
        f"tok/s bs{top}",
        "speedup",
        "TTFT ms",
        *([] if prompt is None else [f"@{prompt}: TTFT s · tok/s · KV MB"]),
        "p95 ms",
        *served,
        "roofline",
        "size MB",
        "peak RSS MB",
        *(["peak GPU MB"] if _on_gpu(board) else []),
    ]


def _on_gpu(board: Leaderboard) -> bool:
    return any(row.score.peak_gpu_mb is not None for row in board.rows)


def table_cells(board: Leaderboard) -> list[list[str]]:
    """Formatted cells of every row, shared by the terminal, markdown and CSV renderings."""
    cells, columns_top = [], max((r.score.top_batch()[0] for r in board.rows), default=1)
    clients, gpu, longest = served_top(board), _on_gpu(board), longest_measured(board.rows)
    facts, prompt = longest_retrieval(board.rows), longest_speed(board.rows)
    lengths = capacity_lengths(board)
    for row in board.rows:
        s = row.score
        mark = (" ★" if s.variant == board.winner else "") + (" ◆" if row.on_frontier else "")
        mark += "" if row.within_budget else " ✗"
        mark += " ⏱" if s.short_benchmark else ""
        top, top_speed = s.top_batch()
        cells.append(
            [
                s.variant + mark,
                f"{s.perplexity:.2f}",
                f"{row.ppl_ratio:.3f} ({row.ppl_ratio_low:.3f}–{row.ppl_ratio_high:.3f})",
                *([] if longest is None else [length_cell(row.long_context, longest)]),
                *([] if facts is None else [retrieval_cell(s.retrieval, facts)]),
                f"{s.token_agreement:.0%}",
                f"{s.cloze_accuracy:.0%} (p={row.cloze_p_value:.2f})",
                f"{s.decode_tok_s:.1f}",
                f"{top_speed:.1f}" if top == columns_top else NOT_MEASURED,
                f"{row.speedup:.2f}" if row.speedup == row.speedup else NOT_MEASURED,
                f"{s.ttft_ms:.0f}",
                *([] if prompt is None else [speed_cell(s.speed_at_length, prompt)]),
                NOT_MEASURED if s.short_benchmark else f"{s.latency_p95_ms:.0f}",
                *([] if clients is None else _served_cells(s, clients)),
                *([_capacity_cell(s, lengths)] if lengths else []),
                f"{s.roofline_fraction:.0%}",
                f"{s.size_bytes / 1e6:.0f}",
                f"{s.peak_rss_mb:.0f}",
                *([] if not gpu else [NOT_MEASURED if s.peak_gpu_mb is None else f"{s.peak_gpu_mb:.0f}"]),
            ]
        )
    return cells


def _served_cells(score: VariantScore, clients: int) -> list[str]:
    level = next((level for level in score.served if level.concurrency == clients), None)
    if level is None:
        return [NOT_MEASURED, NOT_MEASURED]
    return [f"{level.tok_s:.1f}", f"{level.ttft_p95_ms:.0f}"]

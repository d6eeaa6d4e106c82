"""The leaderboard's files: JSON, CSV, markdown, the DVC metrics file and the plots, written into one folder."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.decide.select import Leaderboard
from tasks.report.plots import speed_plot, tradeoff_plot


def write_reports(board: Leaderboard, folder: Path) -> list[Path]:
    """Leaderboard as JSON, CSV and markdown, the DVC metrics file and the plots; returns the files."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "leaderboard.json": board.to_json(),
        "leaderboard.csv": board.to_csv(),
        "leaderboard.md": board.to_markdown(),
        "metrics.json": json.dumps(board.metrics(), indent=2, sort_keys=True) + "\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    plots = [tradeoff_plot(board, folder / "tradeoff.png"), speed_plot(board, folder / "speed.png")]
    return [folder / name for name in files] + plots

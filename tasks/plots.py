"""Plots for the run report: people compare variants faster on a picture than in a table."""

from __future__ import annotations

from pathlib import Path

from tasks.select import Leaderboard


def tradeoff_plot(board: Leaderboard, path: Path) -> Path:
    """Decode speed (x, log) against perplexity ratio with its CI (y); budget line; winner starred."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    for row in board.rows:
        colour = (
            "#d4a017"
            if row.score.variant == board.winner
            else ("#2e7d32" if row.within_budget else "#c62828")
        )
        error = [[row.ppl_ratio - row.ppl_ratio_low], [row.ppl_ratio_high - row.ppl_ratio]]
        marker = "*" if row.score.variant == board.winner else "o"
        axes.errorbar(
            row.score.decode_tok_s,
            row.ppl_ratio,
            yerr=error,
            fmt=marker,
            color=colour,
            markersize=11,
            capsize=4,
        )
        axes.annotate(
            row.score.variant,
            (row.score.decode_tok_s, row.ppl_ratio),
            textcoords="offset points",
            xytext=(7, 5),
            fontsize=9,
        )
    axes.axhline(
        1 + board.max_ppl_increase,
        color="#c62828",
        linestyle="--",
        linewidth=1,
        label=f"budget: +{board.max_ppl_increase:.0%} perplexity",
    )
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xscale("log")
    axes.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes.set_xlabel("decode tokens/s (batch 1, log scale)")
    axes.set_ylabel(f"perplexity ÷ {board.baseline} ({board.confidence:.0%} CI)")
    axes.set_title("Speed vs accuracy: up-left is worse, down-right is better")
    axes.legend(loc="upper left")
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path

"""Plots for the run report: people compare variants faster on a picture than in a table."""

from __future__ import annotations

from pathlib import Path

from tasks.decide.select import Leaderboard


def tradeoff_plot(board: Leaderboard, path: Path) -> Path:
    """Decode speed on the objective (x, log) against perplexity ratio with its CI (y); budget line; winner
    starred; Pareto-frontier variants ringed."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    speed = {row.score.variant: row.score.speed(board.objective) for row in board.rows}
    frontier = [row for row in board.rows if row.on_frontier]
    axes.scatter(
        [speed[r.score.variant] for r in frontier],
        [r.ppl_ratio for r in frontier],
        s=260,
        facecolors="none",
        edgecolors="#1565c0",
        linewidths=1.5,
        label="Pareto frontier (accuracy, speed, memory)",
        zorder=3,
    )
    for row in board.rows:
        colour = (
            "#d4a017"
            if row.score.variant == board.winner
            else ("#2e7d32" if row.within_budget else "#c62828")
        )
        error = [[row.ppl_ratio - row.ppl_ratio_low], [row.ppl_ratio_high - row.ppl_ratio]]
        marker = "*" if row.score.variant == board.winner else "o"
        axes.errorbar(
            speed[row.score.variant],
            row.ppl_ratio,
            yerr=error,
            fmt=marker,
            color=colour,
            markersize=11,
            capsize=4,
        )
        axes.annotate(
            row.score.variant,
            (speed[row.score.variant], row.ppl_ratio),
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
    batch = "largest batch, all sequences" if board.objective == "throughput" else "batch 1"
    axes.set_xlabel(f"decode tokens/s ({batch}, log scale)")
    axes.set_ylabel(f"perplexity ÷ {board.baseline} ({board.confidence:.0%} CI)")
    axes.set_title("Speed vs accuracy: up-left is worse, down-right is better")
    axes.legend(loc="upper left")
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def speed_plot(board: Leaderboard, path: Path) -> Path:
    """Three panels per variant: aggregate decode tok/s and per-sequence ms/token by batch size, TTFT by prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, per_token, ttft) = plt.subplots(1, 3, figsize=(15, 4.8), dpi=110)
    for row in board.rows:
        score = row.score
        sizes = [b for b, _ in score.batch_decode_tok_s]
        rates = [r for _, r in score.batch_decode_tok_s]
        throughput.plot(sizes, rates, marker="o", label=score.variant)
        per_token.plot(sizes, [1000 * b / r for b, r in score.batch_decode_tok_s], marker="o")
        ttft.plot(*zip(*score.ttft_ms_by_prompt, strict=True), marker="o")
    for axes, title, ylabel, xlabel in (
        (throughput, "Throughput by batch size", "decode tokens/s (all sequences)", "batch size"),
        (per_token, "Latency per output token", "ms per token per sequence", "batch size"),
        (ttft, "Time to first token (batch 1)", "TTFT ms", "prompt tokens"),
    ):
        axes.set(title=title, ylabel=ylabel, xlabel=xlabel)
        axes.set_yscale("log")
        axes.grid(True, which="both", alpha=0.3)
    throughput.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path

"""Plots for the run report: people compare variants faster on a picture than in a table."""

from __future__ import annotations

from pathlib import Path

from tasks.decide.leaderboard_table import served_top
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
    rows = [
        row for row in board.rows if speed[row.score.variant] == speed[row.score.variant]
    ]  # nan: not served
    frontier = [row for row in rows if row.on_frontier]
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
    for row in rows:
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
    clients = served_top(board)
    if board.objective == "serving" and clients is not None:
        slo = any(r.score.top_served().goodput_rps == r.score.top_served().goodput_rps for r in rows)
        measure = "requests/s within the SLO" if slo else "generated tokens/s"
        axes.set_xlabel(f"served {measure} ({clients} clients, log scale)")
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


def precision_plot(plan: dict, path: Path) -> Path:
    """A mixed-precision plan: every exported matrix's loss cost at 4 bits (what keeping it at 8 bits saves;
    predicted, or measured per layer and shared by parameters), in graph order, the ones kept highlighted, with the
    search's outcome in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrices = plan["matrices"]
    figure, axes = plt.subplots(figsize=(max(8.0, len(matrices) * 0.08), 4.5), dpi=110)
    positions = range(len(matrices))
    costs = [max(m["int4_cost"] - m["int8_cost"], 1e-9) for m in matrices]
    colours = ["tab:orange" if m["bits"] == 8 else "tab:blue" for m in matrices]
    axes.bar(positions, costs, color=colours, width=0.9)
    axes.set_yscale("log")
    gguf = matrices[0]["node"].startswith("blk.")  # llama.cpp's tensor names, else the ONNX builder's nodes
    first = ".attn_q.weight" if gguf else "/qkv_proj/"
    layers = [i for i, m in enumerate(matrices) if first in m["node"]][:: max(1, len(matrices) // 75)]
    axes.set_xticks(layers)
    axes.set_xticklabels([matrices[i]["node"].split("." if gguf else "/")[1 if gguf else 2] for i in layers])
    axes.tick_params(axis="x", labelsize=7, rotation=45)
    kept_as, sensitivity = plan.get("kept_as", "int8"), plan.get("sensitivity", "predicted")
    order = "q, k, v, o, gate, up, down" if gguf else "qkv, o, gate, up, down; last: lm_head"
    axes.set(
        ylabel=f"loss saved at {kept_as} (nats/token, {sensitivity})",
        xlabel=f"matrices in graph order (per {'layer (blk.N)' if gguf else 'layer'}: {order})",
    )
    kept = sum(1 for m in matrices if m["bits"] == 8)
    axes.set_title(
        f"{kept} of {len(matrices)} matrices kept at {kept_as} (orange), stopped by {plan['stopped_by']}: calibration "
        f"perplexity {plan['measured_ppl_increase']:+.1%} (all-int4 {plan['int4_ppl_increase']:+.1%}, target "
        f"{plan['target_ppl_increase']:+.1%}), {plan['size_ratio']:.0%} of int8's bytes",
        fontsize=9,
    )
    axes.grid(True, axis="y", which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path

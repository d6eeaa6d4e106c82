"""The search's picture: every trial by its proxies, distance from the baseline (KL, y) against decode speed (x),
coloured by the stage it reached, the screen's KL limit drawn, the Pareto frontier of the trials (closer, faster,
smaller) ringed, the leader and the winner marked; the raced trials and the frontier named (abbreviated), the rest
dots only, so a space of 50 stays readable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.decide.frontier import pareto_frontier

STAGE_COLOURS = {
    "screened out": "#9e9e9e",
    "dropped": "#c62828",
    "measured": "#1565c0",
    "not confirmed": "#ef6c00",
    "confirmed": "#d4a017",
}


ABBREVIATIONS = (  # a candidate's name as the picture writes it (trials.json and MLflow keep the whole name)
    ("onnx_genai-", "onnx "),
    ("llama_cpp-", "llama "),
    ("-no_mixed_precision", ""),
    ("mixed_precision-", "mixed "),
    ("block_size", "b"),
    ("accuracy_level", "level "),
    ("-no_imatrix", ""),
    ("-", " "),
)


def short_name(name: str) -> str:
    for long, short in ABBREVIATIONS:
        name = name.replace(long, short)
    return name


def _name_points(axes: Any, points: dict[str, tuple], named: set[str], floor: float) -> None:
    """The raced trials and the frontier by name (abbreviated); the rest stay dots."""
    for name in sorted(named):
        kl, speed, _ = points[name]
        axes.annotate(
            short_name(name), (speed, max(kl, floor)), textcoords="offset points", xytext=(6, 4), fontsize=7
        )


def search_plot(
    records: list[dict[str, Any]], leader: tuple[str, float, float] | None, kl_limit: float, path: Path
) -> Path:
    """`records`: trials.json's trials (each with its proxy); `leader`: (name, KL, decode tok/s) or None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proxied = [r for r in records if r.get("proxy")]
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    points = {
        r["name"]: (r["proxy"]["kl"], r["proxy"]["decode_tok_s"], r["proxy"]["stored_bytes"]) for r in proxied
    }
    frontier = set(pareto_frontier(points))
    floor = min([kl for kl, _, _ in points.values() if kl > 0] + [kl_limit]) / 10
    for stage, colour in STAGE_COLOURS.items():
        mine = [r for r in proxied if r["stage"] == stage]
        if mine:
            axes.scatter(
                [r["proxy"]["decode_tok_s"] for r in mine],
                [max(r["proxy"]["kl"], floor) for r in mine],
                color=colour,
                marker="*" if stage == "confirmed" else "o",
                s=160 if stage == "confirmed" else 50,
                label=f"{stage} ({len(mine)})",
                zorder=3,
            )
    ringed = [points[name] for name in frontier]
    axes.scatter(
        [speed for _, speed, _ in ringed],
        [max(kl, floor) for kl, _, _ in ringed],
        s=240,
        facecolors="none",
        edgecolors="#1565c0",
        linewidths=1.2,
        label="Pareto frontier (KL, speed, bytes)",
        zorder=2,
    )
    _name_points(axes, points, {r["name"] for r in proxied if r["stage"] != "screened out"} | frontier, floor)
    if leader is not None:
        name, kl, speed = leader
        axes.scatter(
            [speed], [max(kl, floor)], marker="D", color="black", s=70, label=f"leader: {name}", zorder=4
        )
    axes.axhline(kl_limit, color="#c62828", linestyle="--", linewidth=1, label="the screen's KL limit")
    axes.set_yscale("log")
    axes.margins(x=0.25)  # room for the names on the right
    axes.set_xlabel("decode tok/s, batch 1 (one short decode: the proxy)")
    axes.set_ylabel("KL to the baseline, nats per token (log)")
    axes.set_title("Recipe search: every trial by its proxies")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path

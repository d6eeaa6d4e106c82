"""The run's timeline: every task reports a Span (what ran, on which worker of which machine, from when to when),
so a run shows where its minutes went and proves that no other work ran beside a measurement."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.errors import ComparisonError


@dataclass(frozen=True)
class Span:
    """One task's run: what (`kind` build/evaluate/benchmark/…, `name` the model), where (`worker`) and when
    (epoch seconds). `machine` is the fingerprint hash of the machine, for measurements."""

    kind: str
    name: str
    worker: str
    host: str
    start: float
    end: float
    machine: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def worker_identity() -> str:
    """The Dask worker's address and host when in one, else host and process id."""
    try:
        from distributed import get_worker

        return f"{get_worker().address} on {socket.gethostname()}"
    except (ImportError, ValueError):  # not in a Dask worker
        return f"{socket.gethostname()} pid {os.getpid()}"


@contextlib.contextmanager
def timed(kind: str, name: str, machine: str = "") -> Iterator[list[Span]]:
    """Yield a list that holds the task's Span once the body is done."""
    spans: list[Span] = []
    start = time.time()
    yield spans
    spans.append(Span(kind, name, worker_identity(), socket.gethostname(), start, time.time(), machine))


def overlapping(spans: list[Span]) -> list[tuple[Span, Span]]:
    """Pairs of (measurement, other task) that ran at the same time on the same machine: what must never be."""
    benchmarks = [s for s in spans if s.kind in ("benchmark", "bandwidth")]
    return [
        (bench, other)
        for bench in benchmarks
        for other in spans
        if other is not bench
        and other.host == bench.host
        and other.start < bench.end
        and bench.start < other.end
    ]


def write_timeline(spans: list[Span], folder: Path) -> list[Path]:
    """timeline.json (every span) and timeline.png (one row per worker, one bar per task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "timeline.json"
    data.write_text(json.dumps([asdict(span) for span in spans], indent=1) + "\n")
    if not spans:
        return [data]
    origin = min(span.start for span in spans)
    workers = sorted({span.worker for span in spans})
    colours = {
        "build": "tab:blue",
        "evaluate": "tab:green",
        "benchmark": "tab:red",
        "bandwidth": "tab:orange",
    }
    figure, axes = plt.subplots(figsize=(10, 1.2 + 0.5 * len(workers)))
    for span in spans:
        row = workers.index(span.worker)
        axes.barh(
            row, span.seconds, left=span.start - origin, color=colours.get(span.kind, "tab:gray"), alpha=0.8
        )
        if span.seconds > 0.04 * (max(s.end for s in spans) - origin):
            axes.text(
                span.start - origin + span.seconds / 2, row, span.name, ha="center", va="center", fontsize=7
            )
    axes.set_yticks(range(len(workers)), [w[:40] for w in workers], fontsize=8)
    axes.set_xlabel("seconds since the first task")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axes.legend(handles, colours, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.set_title("Tasks per worker (benchmarks run alone)")
    figure.tight_layout()
    picture = folder / "timeline.png"
    figure.savefig(picture, dpi=110)
    plt.close(figure)
    return [data, picture]


def check_benchmarks_clean(machine: str, spans: list[Span], resource: str) -> None:
    """Every benchmark of a run must run on the kind of machine the run's fingerprint names (`machine`, its hash),
    and no other task of the run beside it (the flow's barrier and one-at-a-time submission make that so; this
    checks they did). `resource`: the Dask worker resource that routes benchmarks, named in the error."""
    machines = {span.machine for span in spans if span.kind in ("benchmark", "bandwidth")}
    if machines - {machine}:
        raise ComparisonError(
            f"benchmarks ran on machines with different fingerprints ({', '.join(sorted(machines))}): "
            f"give the `{resource}` resource to workers of one kind of machine only"
        )
    if clash := overlapping(spans):
        bench, other = clash[0]
        raise ComparisonError(
            f"{other.kind} {other.name} ran on {other.host} during the benchmark of {bench.name}: its figures "
            "are not clean"
        )

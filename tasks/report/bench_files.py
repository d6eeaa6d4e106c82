"""The files of `llmopt bench`: bench.json (every trial and the fingerprint, what a later comparison needs),
spread.csv, and reading an earlier bench.json back for a comparison."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from pathlib import Path

from tasks.errors import ComparisonError
from tasks.measure.benchmark import BenchmarkResult, TrialSpread

BENCH_FILE = "bench.json"


def read_previous(path: Path) -> dict:
    """A bench.json written by an earlier `llmopt bench`; a folder means the bench.json inside it."""
    path = path / BENCH_FILE if path.is_dir() else path
    try:
        previous = json.loads(path.read_text())
        previous["fingerprint"]["hash"]  # noqa: B018  (the one field a comparison needs)
    except FileNotFoundError:
        raise ComparisonError(f"{path}: no such benchmark file") from None
    except (ValueError, KeyError, TypeError):
        raise ComparisonError(f"{path}: not a bench.json written by `llmopt bench`") from None
    return previous


def write_bench_files(
    folder: Path,
    fingerprint: dict,
    bandwidth: float,
    results: dict[str, list[BenchmarkResult]],
    spread: list[TrialSpread],
) -> list[Path]:
    """bench.json (every trial, the fingerprint: what a later comparison needs) and spread.csv."""
    bench = {
        "fingerprint": fingerprint,
        "memory_read_bandwidth_gbs": bandwidth,
        "trials": {name: [asdict(r) for r in runs] for name, runs in results.items()},
        "spread": [asdict(row) for row in spread],
    }
    (folder / BENCH_FILE).write_text(json.dumps(bench, indent=2) + "\n")
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(
        ["variant", "metric", "median", "spread", *[f"trial{i + 1}" for i in range(len(spread[0].values))]]
    )
    for row in spread:
        writer.writerow([row.variant, row.metric, f"{row.median:.3f}", f"{row.spread:.4f}", *row.values])
    (folder / "spread.csv").write_text(buffer.getvalue())
    return [folder / BENCH_FILE, folder / "spread.csv"]


def spread_metrics(spread: list[TrialSpread]) -> dict[str, float]:
    """Each variant's relative spread per headline metric, as flat MLflow metric names."""
    return {f"spread_{_metric_key(row.variant, row.metric)}": row.spread for row in spread}


def _metric_key(variant: str, metric: str) -> str:
    return f"{variant}_{metric}".replace(" ", "_").replace("/", "_per_")

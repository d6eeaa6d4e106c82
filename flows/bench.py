"""The benchmark flow: every variant side by side, repeated trials with their spread, on one machine."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow

from flows.stages import measure_variants, prepare_inputs, rank_and_report, workdir
from tasks.config import Config
from tasks.decide.select import Leaderboard
from tasks.errors import ComparisonError
from tasks.measure.benchmark import (
    BenchmarkResult,
    TrialSpread,
    trial_spread,
)
from tasks.measure.fingerprint import ensure_comparable, machine_fingerprint
from tasks.report.tracking import configure_tracking, parent_run

BENCH_FILE = "bench.json"


@dataclass(frozen=True)
class BenchOutcome:
    leaderboard: Leaderboard
    spread: list[TrialSpread]
    folder: Path
    previous: dict | None  # the compared bench.json (same fingerprint), if any


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


@flow(name="llmopt-bench")
def bench_flow(config: Config, root: Path, trials: int, compare: Path | None = None) -> BenchOutcome:
    """Build (or reuse) and evaluate (or reuse) every variant, then benchmark them all `trials` times."""
    fingerprint = machine_fingerprint(config.target.threads)
    previous = read_previous(compare) if compare else None
    if previous is not None:
        ensure_comparable(previous["fingerprint"], fingerprint)  # refuse before spending minutes measuring
    base, data = prepare_inputs(config, root)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash, "trials": str(trials)}
    with parent_run(experiment_id, config, lineage, fingerprint, kind="bench") as parent_id:
        measured = measure_variants(config, root, base, data, trials)
        spread = trial_spread(measured.trials)
        out = workdir(config, root) / "bench"
        out.mkdir(parents=True, exist_ok=True)
        files = write_bench_files(out, fingerprint, measured.bandwidth_gbs, measured.trials, spread)
        spread_metrics = {f"spread_{_metric_key(r.variant, r.metric)}": r.spread for r in spread}
        board, _ = rank_and_report(config, measured, out, (experiment_id, parent_id), files, spread_metrics)
    return BenchOutcome(board, spread, out, previous)


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


def _metric_key(variant: str, metric: str) -> str:
    return f"{variant}_{metric}".replace(" ", "_").replace("/", "_per_")

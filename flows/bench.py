"""The benchmark flow: every variant side by side, repeated trials with their spread, on one machine."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow, get_run_logger

from flows.pipeline import (
    baseline_first,
    benchmark_task,
    evaluate_task,
    optimize_task,
    prepare_flow_inputs,
    variant_score,
    workdir,
)
from tasks.benchmark import (
    BenchmarkResult,
    TrialSpread,
    median_trial,
    memory_read_bandwidth_gbs,
    trial_spread,
)
from tasks.config import Config
from tasks.data import read_split
from tasks.errors import ComparisonError
from tasks.expectations import validate_metrics_table
from tasks.fingerprint import ensure_comparable, machine_fingerprint
from tasks.select import Leaderboard, build_leaderboard
from tasks.tracking import configure_tracking, log_reports, log_variant_run, parent_run, write_reports

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
    logger = get_run_logger()
    fingerprint = machine_fingerprint(config.target.threads)
    previous = read_previous(compare) if compare else None
    if previous is not None:
        ensure_comparable(previous["fingerprint"], fingerprint)  # refuse before spending minutes measuring
    base, data = prepare_flow_inputs(config, root)
    texts = read_split(data.folder, "evaluation")
    work = workdir(config, root)
    manifests, evaluations, reference = {}, {}, None
    for name, variant in baseline_first(config):
        folder = work / "variants" / name
        manifests[name] = optimize_task(name, variant, base, data, folder)
        evaluations[name] = evaluate_task(
            folder, manifests[name], texts, config, reference, work / "evaluations"
        )
        reference = reference or evaluations[name].continuations
    bandwidth = memory_read_bandwidth_gbs(config.target.threads)
    results: dict[str, list[BenchmarkResult]] = {name: [] for name in manifests}
    for trial in range(trials):  # trials interleave variants, so a slow spell of the machine hits all of them
        for name in manifests:
            results[name].append(benchmark_task(work / "variants" / name, config, texts[0]))
            logger.info(f"trial {trial + 1}/{trials} {name}: {results[name][-1].decode_tok_s:.1f} tok/s")
    chosen = {name: median_trial(runs) for name, runs in results.items()}
    scores = [variant_score(n, manifests[n], evaluations[n], chosen[n], bandwidth) for n in manifests]
    validate_metrics_table([asdict(score) for score in scores], list(config.variants))
    board = build_leaderboard(scores, config.select)
    spread = trial_spread(results)
    out = work / "bench"
    reports = write_reports(board, out) + write_bench_files(out, fingerprint, bandwidth, results, spread)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash, "trials": str(trials)}
    with parent_run(experiment_id, config, lineage, fingerprint, kind="bench") as parent_id:
        runs = {
            n: log_variant_run(
                experiment_id, parent_id, config.variants[n], manifests[n], evaluations[n], chosen[n]
            )
            for n in manifests
        }
        spread_metrics = {f"spread_{_metric_key(r.variant, r.metric)}": r.spread for r in spread}
        log_reports(
            parent_id, board, reports, runs, {"memory_read_bandwidth_gbs": bandwidth, **spread_metrics}
        )
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

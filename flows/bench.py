"""The benchmark flow: every variant side by side, repeated trials with their spread, on one machine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.stages import benchmark_fingerprint, measure_variants, prepare_inputs, rank_and_report, workdir
from tasks.decide.select import Leaderboard
from tasks.measure.benchmark import TrialSpread, trial_spread
from tasks.measure.fingerprint import ensure_comparable
from tasks.params import Config
from tasks.report.bench_files import read_previous, spread_metrics, write_bench_files
from tasks.report.tracking import configure_tracking, parent_run


@dataclass(frozen=True)
class BenchOutcome:
    leaderboard: Leaderboard
    spread: list[TrialSpread]
    folder: Path
    previous: dict | None  # the compared bench.json (same fingerprint), if any


@flow(name="llmopt-bench", task_runner=ThreadPoolTaskRunner(max_workers=1))
def bench_flow(config: Config, root: Path, trials: int, compare: Path | None = None) -> BenchOutcome:
    """Build (or reuse) and evaluate (or reuse) every variant, then benchmark them all `trials` times."""
    fingerprint = benchmark_fingerprint(config)
    previous = read_previous(compare) if compare else None
    if previous is not None:
        ensure_comparable(previous["fingerprint"], fingerprint)  # refuse before spending minutes measuring
    base, data = prepare_inputs(config, root)
    experiment_id = configure_tracking(config.tracking, root)
    lineage = {"base_hash": base.content_hash, "data_hash": data.content_hash, "trials": str(trials)}
    with parent_run(experiment_id, config, lineage, fingerprint, kind="bench") as run:
        measured = measure_variants(config, root, base, data, trials, fingerprint)
        spread = trial_spread(measured.trials)
        out = workdir(config, root) / "bench"
        out.mkdir(parents=True, exist_ok=True)
        files = write_bench_files(out, fingerprint, measured.bandwidth_gbs, measured.trials, spread)
        metrics = spread_metrics(spread)
        board, _ = rank_and_report(
            config, measured, out, run=run, extra_reports=tuple(files), run_metrics=metrics
        )
    return BenchOutcome(board, spread, out, previous)

"""The promotion gate: this run's winner (the challenger) against the current production version (the champion),
both measured in the same run, on the same evaluation windows and the same machine.

The challenger moves `production` only when, on the run's objective, it beats the champion with confidence (the
lower bound of the paired speed-ratio interval above 1 + `select.min_improvement`), it is within the accuracy
budget against the baseline (selection made sure), and it is not significantly less accurate than the champion
(paired bootstrap on the perplexity windows beyond `select.ppl_tolerance_vs_production`, McNemar on cloze).
A champion built on another tokenizer cannot be paired: the challenger is then held to this run's baseline budget
only (the champion met its own when it was promoted), and the verdict says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tasks.config import SelectConfig
from tasks.decide.frontier import Objective
from tasks.decide.model_registry import PRODUCTION, version_label
from tasks.decide.select import Leaderboard, VariantScore
from tasks.decide.statistics import mcnemar_exact, paired_bootstrap_ppl_ratio, paired_speed_ratio
from tasks.measure.benchmark import BenchmarkResult


@dataclass(frozen=True)
class Champion:
    """The production version as measured in this run."""

    version: str
    name: str  # its leaderboard name (a variant of this run when the bytes are the same)
    score: VariantScore | None  # None: built on another tokenizer, its windows cannot be paired
    trials: list[BenchmarkResult]


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str  # one line, for the terminal and the registry
    challenger: str | None
    champion_version: str | None
    evidence: dict[str, Any] = field(default_factory=dict)  # statistics, intervals, thresholds

    def tag(self) -> str:
        return f"{'passed' if self.passed else 'refused'}: {self.reason}"


def objective_samples(trials: list[BenchmarkResult], objective: Objective) -> list[float]:
    """Every measured value of the objective, larger is better, in trial order (pairs line up across models)."""
    if objective == "memory":
        return [
            1.0 / (trial.peak_rss_mb if trial.peak_gpu_mb is None else trial.peak_gpu_mb) for trial in trials
        ]
    if objective == "throughput":
        return [run for t in trials for run in max(t.batches, key=lambda b: b.batch_size).decode_tok_s_runs]
    if objective == "serving":  # one served measurement per trial: its capacity at the most clients
        return [max(t.served, key=lambda level: level.concurrency).capacity for t in trials if t.served]
    return [run for trial in trials for run in trial.decode_tok_s_runs]


def judge(
    board: Leaderboard,
    champion: Champion | None,
    challenger_trials: list[BenchmarkResult],
    cfg: SelectConfig,
) -> Verdict:
    """Whether this run's winner may move `production`, with the evidence."""
    winner = board.winner
    if winner is None:
        return Verdict(False, board.reason, None, champion.version if champion else None)
    if champion is None:
        return Verdict(True, f"no production version yet; {winner}: {board.reason}", winner, None)
    if champion.name == winner:
        same = (
            ""
            if winner == version_label(PRODUCTION, champion.version)
            else f" (the same bytes as this run's {winner})"
        )
        reason = f"production v{champion.version}{same} is still the best {board.objective} of this run; nothing to move"
        return Verdict(False, reason, winner, champion.version)
    speed = paired_speed_ratio(
        objective_samples(champion.trials, board.objective),
        objective_samples(challenger_trials, board.objective),
        cfg.bootstrap_resamples,
        cfg.confidence,
        cfg.seed,
    )
    threshold = 1 + cfg.min_improvement
    evidence: dict[str, Any] = {
        "objective": board.objective,
        "speed_ratio": speed.ratio,
        "speed_ratio_ci": [speed.low, speed.high],
        "speed_threshold": threshold,
        "confidence": cfg.confidence,
        "paired_accuracy": champion.score is not None,
    }
    problems = []
    if not speed.low > threshold:  # nan (a zero sample, e.g. no request within the SLO): no evidence either
        problems.append(
            f"{board.objective} ×{speed.ratio:.2f} of production v{champion.version} "
            f"({cfg.confidence:.0%} CI {speed.low:.2f}–{speed.high:.2f}), needs > {threshold:.2f}"
        )
    if champion.score is not None:
        problems += _accuracy_problems(board.row(winner).score, champion, cfg, evidence)
    note = (
        ""
        if champion.score is not None
        else " (champion on another tokenizer: accuracy vs own baseline only)"
    )
    if problems:
        return Verdict(
            False, f"{winner} refused: " + "; ".join(problems) + note, winner, champion.version, evidence
        )
    reason = (
        f"{winner} beats production v{champion.version}: {board.objective} ×{speed.ratio:.2f} "
        f"(CI {speed.low:.2f}–{speed.high:.2f} > {threshold:.2f}){note}"
    )
    return Verdict(True, reason, winner, champion.version, evidence)


def _accuracy_problems(
    challenger: VariantScore, champion: Champion, cfg: SelectConfig, evidence: dict[str, Any]
) -> list[str]:
    """Significant accuracy losses against the champion (paired on the same windows and cloze items)."""
    base = champion.score
    assert base is not None
    ppl = paired_bootstrap_ppl_ratio(
        list(base.window_nll),
        list(base.window_tokens),
        list(challenger.window_nll),
        list(challenger.window_tokens),
        cfg.bootstrap_resamples,
        cfg.confidence,
        cfg.seed,
    )
    cloze = mcnemar_exact(list(base.cloze_correct), list(challenger.cloze_correct))
    evidence.update(
        ppl_ratio_vs_champion=ppl.ratio,
        ppl_ratio_vs_champion_ci=[ppl.low, ppl.high],
        cloze_delta_vs_champion=cloze.accuracy_delta,
        cloze_p_vs_champion=cloze.p_value,
    )
    problems = []
    if ppl.low > 1 + cfg.ppl_tolerance_vs_production:
        problems.append(
            f"perplexity ×{ppl.ratio:.3f} of production (CI {ppl.low:.3f}–{ppl.high:.3f}: significantly worse "
            f"than the {cfg.ppl_tolerance_vs_production:.1%} tolerance)"
        )
    if cloze.accuracy_delta < 0 and cloze.p_value < 1 - cfg.confidence:
        problems.append(f"cloze {cloze.accuracy_delta:+.1%} vs production (McNemar p {cloze.p_value:.3f})")
    return problems


def judged_alone(board: Leaderboard, name: str, version: str) -> Leaderboard:
    """The board with the version under test as its winner, or no winner and the reason it cannot be one."""
    row = next((r for r in board.rows if r.score.variant == name), None)
    if row is None:
        reason = (
            f"v{version} uses another tokenizer than this run's baseline: its accuracy cannot be checked here"
        )
        return replace(board, winner=None, reason=reason + " (move it with --force --reason if you must)")
    if not row.qualifies:
        return replace(board, winner=None, reason=f"v{version} does not qualify: {', '.join(row.failures)}")
    return replace(board, winner=name, reason=f"v{version} qualifies")

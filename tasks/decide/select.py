"""select: the leaderboard, its Pareto frontier, and the variant the run's objective wants among those whose
accuracy stays within budget and that meet the configured constraints."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field, replace

from tasks.config import SelectConfig
from tasks.decide.accuracy import check_accuracy
from tasks.decide.frontier import Objective, pareto_frontier
from tasks.decide.leaderboard_table import NOT_MEASURED, served_top, table_cells, table_columns
from tasks.decide.long_context import (
    LengthRatio,
    LengthScore,
    RetrievalScore,
    length_metrics,
    length_ratios,
    length_scores,
    long_context_failures,
    retrieval_metrics,
    retrieval_scores,
    speed_metrics,
)
from tasks.engines.manifest import VariantManifest
from tasks.errors import ComparisonError
from tasks.measure.benchmark import BenchmarkResult, roofline_fraction
from tasks.measure.evaluate import VariantEvaluation
from tasks.measure.long_context import LengthSpeed
from tasks.measure.served import LevelResult, served_metrics
from tasks.measure.served_lengths import LengthCapacity, capacity_metrics
from tasks.measure.speculation import StyleSpeed
from tasks.params import is_peer_recipe


@dataclass(frozen=True)
class VariantScore:
    """One leaderboard row: what selection needs to know about a variant."""

    variant: str
    perplexity: float
    token_agreement: float  # greedy continuations matching the baseline's, position by position
    cloze_accuracy: float
    decode_tok_s: float
    ttft_ms: float
    size_bytes: int
    peak_rss_mb: float
    parameters: int
    window_nll: tuple[float, ...]  # per evaluation window, for paired comparisons
    window_tokens: tuple[int, ...]
    cloze_correct: tuple[bool, ...]  # per cloze item, for McNemar's paired test
    # Speed beyond batch 1 (NaN/empty when not measured: the metrics suite refuses missing values)
    batch_decode_tok_s: tuple[tuple[int, float], ...] = ()  # (batch size, aggregate decode tok/s)
    ttft_ms_by_prompt: tuple[tuple[int, float], ...] = ()  # (prompt tokens, median TTFT ms)
    latency_p95_ms: float = float("nan")  # end-to-end, fixed request set
    roofline_fraction: float = float("nan")  # decode tok/s ÷ (memory bandwidth ÷ weight bytes)
    peer: bool = False  # the source's own GGUF as shipped: on the leaderboard for comparison, never selected
    short_benchmark: bool = (
        False  # outside the accuracy budget: measured at batch 1 only (BenchmarkConfig.short)
    )
    speculation: tuple[StyleSpeed, ...] = ()  # a speculative variant: with and without it, by prompt style
    # served capacity through the real scheduler, per client count (empty: not measured, e.g. short, peer)
    served: tuple[LevelResult, ...] = ()
    peak_gpu_mb: float | None = None  # on a cuda target: the benchmark's peak of GPU memory allocated
    long_context: tuple[LengthScore, ...] = ()  # by window length (tasks/decide/long_context.py; empty: none)
    retrieval: tuple[RetrievalScore, ...] = ()  # the planted facts' answers by window length (empty: none)
    speed_at_length: tuple[LengthSpeed, ...] = ()  # benchmark.long_prompt_tokens (empty: not measured)
    served_by_length: tuple[LengthCapacity, ...] = ()  # benchmark.served_lengths (empty: not measured)
    # (length, decode speed after it as a share of the memory-bound ceiling: weights and that much KV cache read a token)
    roofline_at_length: tuple[tuple[int, float], ...] = ()

    @property
    def memory_mb(self) -> float:
        """The memory a target is short of: peak GPU memory on a cuda target, else peak resident memory."""
        return self.peak_rss_mb if self.peak_gpu_mb is None else self.peak_gpu_mb

    def top_batch(self) -> tuple[int, float]:
        """(largest measured batch size, its aggregate decode tok/s)."""
        return max(self.batch_decode_tok_s, default=(1, self.decode_tok_s))

    def top_served(self) -> LevelResult | None:
        """The served measurement at the most clients (None: not measured)."""
        return max(self.served, key=lambda level: level.concurrency, default=None)

    def speed(self, objective: Objective) -> float:
        """The speed an objective cares about: aggregate decode at the largest batch for throughput, served
        capacity at the most clients for serving (nan: not measured), else batch-1 decode."""
        if objective == "serving":
            top = self.top_served()
            return top.capacity if top is not None else float("nan")
        return self.top_batch()[1] if objective == "throughput" else self.decode_tok_s


def variant_score(
    name: str,
    manifest: VariantManifest,
    evaluation: VariantEvaluation,
    bench: BenchmarkResult,
    bandwidth_gbs: float,
) -> VariantScore:
    """The leaderboard row of one measured variant."""
    return VariantScore(
        variant=name,
        perplexity=evaluation.perplexity.perplexity,
        token_agreement=evaluation.agreement.token_agreement,
        cloze_accuracy=evaluation.cloze.accuracy,
        cloze_correct=tuple(evaluation.cloze.correct),
        decode_tok_s=bench.decode_tok_s,
        ttft_ms=bench.ttft_ms,
        size_bytes=manifest.size_bytes,
        peak_rss_mb=bench.peak_rss_mb,
        parameters=manifest.parameters,
        window_nll=tuple(evaluation.perplexity.window_nll),
        window_tokens=tuple(evaluation.perplexity.window_tokens),
        batch_decode_tok_s=tuple((b.batch_size, b.decode_tok_s) for b in bench.batches),
        ttft_ms_by_prompt=tuple(sorted(bench.ttft_ms_by_prompt.items())),
        latency_p95_ms=bench.latency_ms["p95"],
        roofline_fraction=roofline_fraction(bench.decode_tok_s, bench.decode_read_bytes, bandwidth_gbs),
        peer=is_peer_recipe(manifest.recipe),
        short_benchmark=bench.short,
        speculation=tuple(bench.speculation or ()),
        served=tuple(bench.served or ()),
        peak_gpu_mb=bench.peak_gpu_mb,
        long_context=length_scores(evaluation),
        retrieval=retrieval_scores(evaluation),
        speed_at_length=tuple(bench.long_context or ()),
        served_by_length=tuple(bench.served_by_length or ()),
        roofline_at_length=tuple(
            (s.length, roofline_fraction(s.decode_tok_s, bench.decode_read_bytes + s.kv_bytes, bandwidth_gbs))
            for s in bench.long_context or ()
            if s.kv_bytes is not None
        ),
    )


@dataclass(frozen=True)
class LeaderboardRow:
    score: VariantScore
    ppl_ratio: float
    ppl_ratio_low: float
    ppl_ratio_high: float
    cloze_p_value: float  # McNemar exact test vs the baseline
    cloze_delta: float
    speedup: float
    within_budget: bool  # the upper confidence bound of the perplexity ratio is within the budget
    failures: tuple[
        str, ...
    ] = ()  # why the row cannot win: accuracy budget, constraints (empty: it qualifies)
    on_frontier: bool = False  # no other variant is as accurate, as fast (objective) and as small, and better
    long_context: tuple[
        LengthRatio, ...
    ] = ()  # per window length: perplexity, ratio to the baseline's, interval

    @property
    def qualifies(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class Leaderboard:
    rows: list[LeaderboardRow]
    baseline: str
    winner: str | None  # None: nothing qualifies (nothing is registered or promoted)
    max_ppl_increase: float
    confidence: float
    objective: Objective = "latency"
    reason: str = ""  # why the winner won, or why nothing did
    failed: dict[str, str] = field(
        default_factory=dict
    )  # variant → why its engine could not run it (not ranked)

    def row(self, variant: str) -> LeaderboardRow:
        return next(r for r in self.rows if r.score.variant == variant)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def winner_summary(self) -> str:
        """One sentence on the winner, for the registry's version description."""
        row = self.row(str(self.winner))
        speed = f"{row.score.decode_tok_s:.1f} decode tok/s"
        if self.objective == "throughput":
            speed = f"{row.score.top_batch()[1]:.1f} decode tok/s at batch {row.score.top_batch()[0]}"
        top = row.score.top_served()
        if self.objective == "serving" and top is not None:
            goodput = (
                f"{top.goodput_rps:.2f} req/s within the SLO, " if top.goodput_rps == top.goodput_rps else ""
            )
            speed = f"{goodput}{top.tok_s:.1f} tok/s served to {top.concurrency} clients"
        return (
            f"{self.winner}: {speed} ({row.speedup:.2f}× {self.baseline}), "
            f"perplexity {row.score.perplexity:.2f} (×{row.ppl_ratio:.3f}, {self.confidence:.0%} CI "
            f"{row.ppl_ratio_low:.3f}–{row.ppl_ratio_high:.3f}), {row.score.size_bytes / 1e6:.0f} MB"
        )

    def metrics(self) -> dict[str, dict[str, float]]:
        """Numbers only, keyed by variant: the shape `dvc metrics show/diff` reads."""
        return {
            row.score.variant: {
                "perplexity": round(row.score.perplexity, 4),
                "token_agreement": round(row.score.token_agreement, 4),
                "cloze_accuracy": round(row.score.cloze_accuracy, 4),
                "cloze_p_value": round(row.cloze_p_value, 4),
                "ppl_ratio": round(row.ppl_ratio, 4),
                "ppl_ratio_ci_low": round(row.ppl_ratio_low, 4),
                "ppl_ratio_ci_high": round(row.ppl_ratio_high, 4),
                "decode_tok_s": round(row.score.decode_tok_s, 2),
                **{f"decode_tok_s_bs{b}": round(v, 2) for b, v in row.score.batch_decode_tok_s},
                "ttft_ms": round(row.score.ttft_ms, 1),
                **{f"ttft_ms_prompt{n}": round(v, 1) for n, v in row.score.ttft_ms_by_prompt},
                **(
                    {}
                    if row.score.short_benchmark
                    else {"latency_p95_ms": round(row.score.latency_p95_ms, 1)}
                ),
                "roofline_fraction": round(row.score.roofline_fraction, 4),
                **served_metrics(row.score.served),
                "size_mb": round(row.score.size_bytes / 1e6, 1),
                "peak_rss_mb": round(row.score.peak_rss_mb, 1),
                **({} if row.score.peak_gpu_mb is None else {"peak_gpu_mb": round(row.score.peak_gpu_mb, 1)}),
                "on_frontier": int(row.on_frontier),
                **length_metrics(row.long_context),
                **retrieval_metrics(row.score.retrieval),
                **speed_metrics(row.score.speed_at_length, row.score.roofline_at_length),
                **capacity_metrics(row.score.served_by_length),
            }
            for row in self.rows
        }

    def to_csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow([*table_columns(self), "parameters", "within_budget", "on_frontier", "failures"])
        for cells, row in zip(table_cells(self), self.rows, strict=True):
            numbers = [
                "" if cell == NOT_MEASURED else cell for cell in cells
            ]  # a blank, for tools reading it
            writer.writerow(
                [*numbers, row.score.parameters, row.within_budget, row.on_frontier, "; ".join(row.failures)]
            )
        return buffer.getvalue()

    def legend(self) -> str:
        """What the marks after a variant's name mean (those that occur)."""
        legend = "★ winner, ◆ Pareto frontier (accuracy, speed, memory), ✗ outside the accuracy budget"
        if any(r.score.short_benchmark for r in self.rows):
            legend += (
                ", ⏱ short benchmark (outside the budget, never selected: batch 1 and the largest batch only, the "
                "shortest and longest TTFT prompts, a third of the requests, so no p95)"
            )
        clients = served_top(self)
        if clients is not None:
            legend += (
                f"; c{clients}: served to {clients} clients through llmopt's scheduler (– not measured: the peer "
                "row, a short benchmark, the baseline unless the objective is serving)"
            )
        return legend

    def to_markdown(self) -> str:
        columns = table_columns(self)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cells) + " |" for cells in table_cells(self)]
        legend = self.legend()
        verdict = f"Winner: **{self.winner}**" if self.winner else "No winner"
        text = "\n".join(lines) + f"\n\n{legend}.\n\n{verdict} ({self.reason}; reference: {self.baseline}).\n"
        return text + self.failed_markdown() + self.speculation_markdown()

    def failed_markdown(self) -> str:
        """The variants the run built but could not measure, each with its engine's refusal ('' when none)."""
        if not self.failed:
            return ""
        lines = [f"- **{name}**: {why}" for name, why in sorted(self.failed.items())]
        return (
            "\nFailed, left out of the ranking (the run went on without them):\n\n" + "\n".join(lines) + "\n"
        )

    def speculation_markdown(self) -> str:
        """The speculative variants' own measurement: each prompt style generated with and without speculation
        (batch 1, prefill included, same prompts, interleaved), '' when no variant speculates."""
        rows = [(r.score.variant, style) for r in self.rows for style in r.score.speculation]
        if not rows:
            return ""
        lines = [
            "\nSpeculative decoding (batch 1, prefill included; the same prompts with and without it):\n",
            "| variant | prompt style | tok/s without → with | × (CI) | proposals kept | tokens per call | "
            "same tokens as without |",
            "|---|---|---|---|---|---|---|",
        ]
        for variant, s in rows:
            lines.append(
                f"| {variant} | {s.style} ({s.prompt_tokens} tokens) | {s.plain_tok_s:.1f} → "
                f"{s.speculative_tok_s:.1f} | {s.ratio:.2f} ({s.ratio_ci[0]:.2f}–{s.ratio_ci[1]:.2f}) | "
                f"{s.acceptance:.0%} of {s.proposed} | {s.tokens_per_call:.2f} | {s.agreement:.0%} |"
            )
        return "\n".join(lines) + "\n"


def build_leaderboard(scores: list[VariantScore], cfg: SelectConfig) -> Leaderboard:
    """Rank by the objective's key; the winner is the best qualifying variant: its perplexity ratio to the
    baseline stays within the budget at the configured confidence (upper bound of the paired bootstrap
    interval), its cloze accuracy is not significantly worse (McNemar exact test at the same confidence), and it
    meets every configured constraint. The winner is on the frontier of the qualifying variants.

    The metrics are expected to have passed `validate_metrics_table` (finite, positive, all variants present).
    """
    by_name = {s.variant: s for s in scores}
    if cfg.baseline not in by_name:
        raise ComparisonError(f"select: baseline {cfg.baseline!r} has no measurements")
    base = by_name[cfg.baseline]
    rows = sorted(
        (_row(s, base, cfg) for s in scores), key=lambda r: objective_key(r, cfg.objective), reverse=True
    )
    frontier = set(pareto_frontier({r.score.variant: _point(r, cfg.objective) for r in rows}))
    rows = [replace(r, on_frontier=r.score.variant in frontier) for r in rows]
    qualifying = [r for r in rows if r.qualifies]
    winner = qualifying[0].score.variant if qualifying else None
    board = Leaderboard(rows, cfg.baseline, winner, cfg.max_ppl_increase, cfg.confidence, cfg.objective)
    return replace(board, reason=_reason(board, len(qualifying)))


def objective_key(row: LeaderboardRow, objective: Objective) -> tuple[float, ...]:
    """Larger is better: the objective's measure, then accuracy and memory break ties (for memory, whose measure
    is the peak memory, GPU memory on a cuda target, then size: accuracy, then batch-1 speed)."""
    s = row.score
    if objective == "memory":
        return (-s.memory_mb, -s.size_bytes, -row.ppl_ratio, s.decode_tok_s)
    return (_measured(s.speed(objective)), -row.ppl_ratio, -s.memory_mb)


def _measured(speed: float) -> float:
    """A speed to compare: not measured (nan: a row without served capacity) ranks below every measured one."""
    return speed if speed == speed else float("-inf")


def _point(row: LeaderboardRow, objective: Objective) -> tuple[float, float, float]:
    return (row.ppl_ratio, _measured(row.score.speed(objective)), row.score.memory_mb)


def _reason(board: Leaderboard, qualifying: int) -> str:
    if board.winner is not None:
        return f"best {board.objective} of {qualifying} qualifying variant{'s' if qualifying != 1 else ''}"
    details = "; ".join(f"{r.score.variant}: {', '.join(r.failures)}" for r in board.rows)
    return f"no variant qualifies ({details})"


def constraint_failures(score: VariantScore, speedup: float, cfg: SelectConfig) -> list[str]:
    """The configured constraints `score` breaks, in words."""
    failures = []
    if cfg.max_ttft_ms is not None and score.ttft_ms > cfg.max_ttft_ms:
        failures.append(f"TTFT {score.ttft_ms:.0f} ms > max_ttft_ms {cfg.max_ttft_ms:g}")
    if cfg.max_rss_mb is not None and score.peak_rss_mb > cfg.max_rss_mb:
        failures.append(f"peak RSS {score.peak_rss_mb:.0f} MB > max_rss_mb {cfg.max_rss_mb:g}")
    if cfg.max_gpu_mb is not None and (score.peak_gpu_mb or 0.0) > cfg.max_gpu_mb:
        failures.append(f"peak GPU memory {score.peak_gpu_mb:.0f} MB > max_gpu_mb {cfg.max_gpu_mb:g}")
    if cfg.max_size_mb is not None and score.size_bytes / 1e6 > cfg.max_size_mb:
        failures.append(f"size {score.size_bytes / 1e6:.0f} MB > max_size_mb {cfg.max_size_mb:g}")
    if cfg.min_speedup is not None and speedup < cfg.min_speedup:
        failures.append(f"speedup {speedup:.2f} < min_speedup {cfg.min_speedup:g}")
    return failures


def _row(score: VariantScore, base: VariantScore, cfg: SelectConfig) -> LeaderboardRow:
    check = check_accuracy(
        (base.window_nll, base.window_tokens, base.cloze_correct),
        (score.window_nll, score.window_tokens, score.cloze_correct),
        cfg,
        is_baseline=score.variant == cfg.baseline,
    )
    interval, cloze, within_budget = check.interval, check.cloze, check.within_budget
    failures = [] if check.failure is None else [check.failure]
    at_length = length_ratios(score.long_context, base.long_context, cfg)
    if score.variant != cfg.baseline:  # the budget at long context, where measured
        at_length_failures = long_context_failures(at_length, score.retrieval, base.retrieval, cfg)
        within_budget, failures = within_budget and not at_length_failures, failures + at_length_failures
    if score.peer:
        failures.insert(0, PEER_FAILURE)
    elif cfg.objective == "serving" and score.top_served() is None and within_budget:
        failures.append("no served capacity measured (objective: serving)")
    base_speed = base.speed(cfg.objective)
    speedup = score.speed(cfg.objective) / base_speed if base_speed > 0 else float("nan")
    return LeaderboardRow(
        score=score,
        ppl_ratio=interval.ratio,
        ppl_ratio_low=interval.low,
        ppl_ratio_high=interval.high,
        cloze_p_value=cloze.p_value,
        cloze_delta=cloze.accuracy_delta,
        speedup=speedup,
        within_budget=within_budget,
        failures=tuple(failures + constraint_failures(score, speedup, cfg)),
        long_context=at_length,
    )


PEER_FAILURE = "peer row (the source's own GGUF as shipped): measured for comparison, never selected"

"""What a search runs, from params.yaml: the candidates (params.yaml's own variants, then the space's combinations
that are not one of them), the race plan, the windows each split reads, the leader, and the record it leaves
(trials.json, the winner's `variants:` block). Pure functions; flows/search.py runs them."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tasks.errors import ConfigError
from tasks.measure.evaluate import make_windows
from tasks.params import Config, VariantConfig
from tasks.search.driver import RacePlan, SearchOutcome
from tasks.search.proxies import Proxy
from tasks.search.space import Candidate, expand, variant_block


def race_plan(config: Config) -> RacePlan:
    s = config.search
    return RacePlan(
        max_ppl_increase=config.select.max_ppl_increase,
        alpha=s.alpha,
        rounds=s.rounds,
        pairs_per_round=s.pairs_per_round,
        windows_per_round=s.windows_per_round,
        keep=s.keep,
        kl_margin=s.kl_margin,
        confirm_pairs=s.confirm_pairs,
        confirm_windows=s.confirm_windows,
        baseline=config.select.baseline,
    )


def proposals(config: Config) -> tuple[dict[str, VariantConfig], dict[str, Candidate], list[str]]:
    """(params.yaml's variants that race: not the baseline, not a peer row; the space's candidates that are not one
    of them, every one: the sampler proposes those it builds, sampler.py; notes on what was left out)."""
    if config.target.tensor_parallel > 1:
        raise ConfigError(
            "search: each variant runs in one process of its own; set target.tensor_parallel: 1"
        )
    if not config.search.space:
        raise ConfigError("search.space is empty: list the techniques and choices to search (docs/search.md)")
    space, notes = expand(config.search.space), []
    defaults = {
        name: variant
        for name, variant in config.variants.items()
        if name != config.select.baseline and not variant.peer
    }
    known = {variant.recipe_hash(): name for name, variant in config.variants.items()}
    candidates = {}
    for candidate in space.candidates:
        same = known.get(candidate.variant.recipe_hash())
        if same in defaults:
            notes.append(f"{candidate.name}: params.yaml's {same}, raced as that")
        elif same is not None:
            notes.append(
                f"{candidate.name}: params.yaml's {same}, which is not raced (the baseline or a peer row)"
            )
        elif candidate.variant.peer:
            notes.append(f"{candidate.name}: a peer row (the source's own model as shipped), never selected")
        elif candidate.name in config.variants:
            notes.append(
                f"{candidate.name}: the name of another params.yaml variant; left out (rename that one)"
            )
        else:
            candidates[candidate.name] = candidate
    for technique, (count, reason) in space.refused.items():
        notes.append(f"{technique}: {count} combinations refused ({reason})")
    return defaults, candidates, notes


def candidate_room(config: Config, defaults: int) -> int:
    """How many of the space's candidates a search may build: `search.max_candidates` less params.yaml's variants."""
    return max(config.search.max_candidates - defaults, 0)


def split_windows(
    encode: Any, calibration: list[str], evaluation: list[str], config: Config
) -> dict[str, list[list[int]]]:
    """The proxy windows (calibration split), the race's and the held-out confirmation's (evaluation split,
    disjoint), each of `search.window_tokens` tokens; too few evaluation windows is an error naming the settings."""
    s, size = config.search, config.search.window_tokens
    proxy = make_windows(encode("\n\n".join(calibration)), size, size * s.proxy_windows)
    evaluation_windows = [
        w for w in make_windows(encode("\n\n".join(evaluation)), size, 10**9) if len(w) == size
    ]
    race = s.rounds * s.windows_per_round
    if len(evaluation_windows) < s.windows_needed():
        raise ConfigError(
            f"search: the evaluation split gives {len(evaluation_windows)} windows of {size} tokens, the race and "
            f"its confirmation read {s.windows_needed()} (search.rounds × windows_per_round + confirm_windows): "
            "lower those or search.window_tokens, or raise data.evaluation_passages"
        )
    return {
        "proxy": proxy,
        "search": evaluation_windows[:race],
        "confirm": evaluation_windows[race : race + s.confirm_windows],
    }


def choose_leader(
    config: Config, proxies: dict[str, Proxy], kl_limit: float, production: str | None = None
) -> str:
    """`search.leader`; else the params.yaml variant holding production's bytes (what a winner must beat at the
    gate; one short decode is too rough to pick among close variants: on the default model it put llama.cpp's Q4_0
    mixed ahead of the ONNX int4 winner the benchmark has ×1.06 faster); else the fastest of params.yaml's racing
    variants on the proxies' short decode whose KL is within the screen's limit (the baseline when none is)."""
    if config.search.leader is not None:
        return config.search.leader
    if production is not None and production in proxies:
        return production
    fit = [p for p in proxies.values() if p.kl <= kl_limit]
    return max(fit, key=lambda p: p.decode_tok_s).candidate if fit else config.select.baseline


def trial_records(outcome: SearchOutcome, recipes: dict[str, dict]) -> list[dict[str, Any]]:
    """Every trial as JSON: its recipe, the stage it reached, why it stopped, its proxies and its last looks."""
    records = []
    for name, trial in outcome.trials.items():
        last = trial.looks[-1] if trial.looks else None
        records.append(
            {
                "name": name,
                "recipe": recipes.get(name, {}),
                "stage": trial.stage,
                "reason": trial.reason,
                "proxy": asdict(trial.proxy) if trial.proxy else None,
                "rounds": len(trial.looks),
                "speed": asdict(last.speed) if last and last.speed else None,
                "accuracy": asdict(last.accuracy) if last and last.accuracy else None,
                "pairs": len(trial.speeds[0]),
            }
        )
    return records


def write_record(
    folder: Path, outcome: SearchOutcome, recipes: dict[str, dict], winner_block: str | None
) -> list[Path]:
    """trials.json (and winner.yaml, the winner's `variants:` block, when one was confirmed) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"counts": outcome.counts(), "winner": outcome.winner, "trials": trial_records(outcome, recipes)}
    files = [folder / "trials.json"]
    files[0].write_text(json.dumps(record, indent=2, default=str) + "\n")
    winner = folder / "winner.yaml"
    winner.unlink(missing_ok=True)
    if winner_block is not None:
        winner.write_text("variants:\n" + winner_block)
        files.append(winner)
    return files


def winner_block(outcome: SearchOutcome, candidates: dict[str, Candidate]) -> str | None:
    """The confirmed winner as a `variants:` entry (None: no winner, or a params.yaml variant already there)."""
    if outcome.winner is None or outcome.winner not in candidates:
        return None
    return variant_block(candidates[outcome.winner])

"""Production moves: one lock for every writer, one history record per decision, rollback.

MLflow keeps no history of alias moves and has no compare-and-set for aliases. So:
- every move takes a registry lock: a registered model named `<model>.llmopt-lock`, created to acquire
  (creation is unique in every MLflow store, the embedded one and a shared tracking server alike) and deleted to
  release; a lock whose holder process on this host is gone is broken;
- under the lock the alias is read again: if production moved since the decision was made, nothing moves and the
  lost race is recorded;
- every decision (moved or not) is one registered-model tag `llmopt.history.<ns>-<random>` holding a JSON record,
  a unique key per record: concurrent writers never overwrite each other, and the MLflow UI shows the tags on the
  model's page;
- a move is a recoverable transaction: its intent (the record to be, and the version tags as they were) is written
  first as the model's `llmopt.production_intent` tag, then the version's tags, the alias and the history record,
  and the intent is deleted last. A process killed in between leaves the intent behind; the next move, rollback,
  history or run (`recover_unfinished_move`, under the lock) completes it where the alias had already moved (the
  record is written) or rolls it back where it had not (the version's tags restored, the refusal recorded), and
  says which.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from dataclasses import asdict, dataclass

from tasks.decide.gate import Verdict
from tasks.decide.model_registry import (
    PRODUCTION,
    RegisteredVersion,
    Registration,
    current_version,
    model_tags,
    registry_lock,
    set_alias,
    tag_model,
    tag_version,
    untag_version,
    version_tags,
)
from tasks.errors import RegistryError
from tasks.failpoints import failpoint

HISTORY_PREFIX = "llmopt.history."
INTENT_TAG = "llmopt.production_intent"
MOVE_TAGS = ("llmopt.gate", "llmopt.previous_production")  # what a move writes on the version it moves to
MAX_REASON = 2000  # registry tag values are limited (5000 characters)


@dataclass(frozen=True)
class Move:
    """One decision about `production`: what moved (or why not), who decided, when."""

    time: str  # ISO 8601, UTC
    actor: str  # "run <mlflow run id>", "llmopt promote", "llmopt rollback"
    kind: str  # "gate" (the champion/challenger gate), "forced", "rollback", "lost-race"
    from_version: str | None
    to_version: str | None
    moved: bool
    reason: str


def record(model_name: str, move: Move) -> None:
    """Append one history record (a tag with a key of its own)."""
    key = f"{HISTORY_PREFIX}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    tag_model(
        model_name, key, json.dumps({**asdict(move), "reason": move.reason[:MAX_REASON]}, sort_keys=True)
    )


def record_refusal(
    model_name: str, actor: str, from_version: str | None, to_version: str | None, reason: str
) -> None:
    """Record a gate decision that left production where it was."""
    record(model_name, Move(_now(), actor, "gate", from_version, to_version, False, reason))


def history(model_name: str) -> list[Move]:
    """Every recorded decision about `production`, oldest first."""
    tags = model_tags(model_name)
    if tags is None:
        raise RegistryError(f"no registered model {model_name!r}; run `llmopt run` first")
    return [Move(**json.loads(tags[key])) for key in sorted(k for k in tags if k.startswith(HISTORY_PREFIX))]


def move_production(
    model_name: str,
    to_version: str,
    expected_from: str | None,
    actor: str,
    kind: str,
    reason: str,
    gate_tag: str,
) -> bool:
    """Move `production` to `to_version` if it still points where the decision saw it; record either way."""
    with registry_lock(model_name, actor):
        _recover(model_name)
        current = current_version(model_name, PRODUCTION)
        if current == to_version == expected_from:
            return True  # already there: nothing to move, nothing to record
        if current != expected_from:
            lost = f"production moved from {_v(expected_from)} to {_v(current)} while this was decided; not moved"
            record(
                model_name, Move(_now(), actor, "lost-race", current, to_version, False, f"{lost}. {reason}")
            )
            return False
        move = Move(_now(), actor, kind, current, to_version, True, reason[:MAX_REASON])
        before = version_tags(model_name, to_version)
        intent = {"move": asdict(move), "tags": {key: before.get(key) for key in MOVE_TAGS}}
        tag_model(model_name, INTENT_TAG, json.dumps(intent, ensure_ascii=False))
        failpoint("promote-intent")
        tag_version(model_name, to_version, "llmopt.gate", gate_tag[:MAX_REASON])
        if current is not None and current != to_version:
            tag_version(model_name, to_version, "llmopt.previous_production", current)
        failpoint("promote-tags")
        set_alias(model_name, PRODUCTION, to_version)
        failpoint("promote-alias")
        record(model_name, move)
        failpoint("promote-recorded")
        tag_model(model_name, INTENT_TAG, None)
    return True


def recover_unfinished_move(model_name: str, actor: str) -> str | None:
    """Finish or undo a production move a killed process left half done (see the module docstring); what was
    done, in words, or None when nothing was unfinished (or the model is not registered yet)."""
    if INTENT_TAG not in (model_tags(model_name, unanswered_is_missing=True) or {}):  # a look before the lock
        return None
    with registry_lock(model_name, actor):
        return _recover(model_name)


def _recover(model_name: str) -> str | None:
    """`recover_unfinished_move` under the lock already held."""
    text = (model_tags(model_name) or {}).get(INTENT_TAG)
    if text is None:
        return None
    try:
        intent = json.loads(text)
        move = Move(**intent["move"])
    except (ValueError, TypeError, KeyError):
        raise RegistryError(
            f"{model_name}: the tag {INTENT_TAG} (an interrupted production move) cannot be read; check where the "
            "production alias points, then delete the tag"
        ) from None
    to = _v(move.to_version)
    if current_version(model_name, PRODUCTION) == move.to_version:
        recorded = move in history(model_name)
        if not recorded:
            record(model_name, move)
        tag_model(model_name, INTENT_TAG, None)
        done = f"completed an interrupted move of production to {to} (the alias had moved"
        return done + ("; its history record is written now)" if not recorded else ")")
    for key, value in intent["tags"].items():  # the version's tags as they were before the move began
        if value is None:
            untag_version(model_name, move.to_version, key)
        else:
            tag_version(model_name, move.to_version, key, value)
    undone = f"rolled back an interrupted move of production to {to} (the alias had not moved; it stays on "
    undone += f"{_v(current_version(model_name, PRODUCTION))})"
    record(
        model_name, Move(_now(), "recovery", "interrupted", move.from_version, move.to_version, False, undone)
    )
    tag_model(model_name, INTENT_TAG, None)
    return undone


def rollback_target(model_name: str) -> tuple[str, str]:
    """(current production, the version production pointed to before the move that made it current)."""
    current = current_version(model_name, PRODUCTION)
    for move in reversed(history(model_name)):
        if move.moved and move.to_version == current and move.from_version not in (None, current):
            return current, move.from_version
    raise RegistryError(f"{model_name}: no earlier production version to roll back to (see `llmopt history`)")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _v(version: str | None) -> str:
    return f"v{version}" if version is not None else "none"


def apply_verdict(
    model: str,
    verdict: Verdict,
    production: RegisteredVersion | None,
    registration: Registration | None,
    actor: tuple[str, str],
) -> bool:
    """Store the verdict on the judged version and move production if it passed (under the registry lock);
    every decision is recorded. Production's own evidence is kept when it stays the best. `actor` is (who
    decides, the machine fingerprint)."""
    who, fingerprint = actor
    before = production.version if production else None
    judged = registration.version if registration else None
    if judged is None or judged == before:
        if production is not None:
            record_refusal(model, who, before, judged, verdict.reason)
        return False
    _store_verdict(model, judged, verdict, fingerprint)
    if not verdict.passed:
        record_refusal(model, who, before, judged, verdict.reason)
        return False
    return move_production(model, judged, before, who, "gate", verdict.reason, verdict.tag())


def _store_verdict(model: str, version: str, verdict: Verdict, fingerprint: str) -> None:
    """The verdict with its evidence on the model version (shown in the MLflow UI's version page)."""
    evidence = {
        "verdict": verdict.tag(),
        "challenger_version": version,
        "champion_version": verdict.champion_version,
        "fingerprint": fingerprint,
        **verdict.evidence,
    }
    tag_version(model, version, "llmopt.verdict", json.dumps(evidence)[:5000])

"""What a search has measured, kept on disk as it goes (`.llmopt/search/journal.json`), so a search killed midway
resumes where it stopped: the course is deterministic given its measurements, so a rerun that is handed the same
proxies, window losses and speed pairs in the same order retraces every decision, and measures only what it had not.

Measurements are kept under each variant's bytes (the base model's and its own content hashes), not its name, so
other bytes under an old name are measured afresh, and a rerun that builds more candidates (a budget that stopped
the first) reuses what it had and measures the rest. The journal's key hashes what every measurement depends on
beside the bytes: the search's settings, the accuracy budget, the windows' and prompt's tokens and the benchmark
machine's fingerprint; with any of them changed it starts afresh. Written whole after each new measurement,
atomically (a kill leaves the last complete one); a search that finishes deletes it (run again, it measures
afresh)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def journal_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Journal:
    """`path` None: kept in memory only (a search measured afresh each time, nothing to resume)."""

    def __init__(self, path: Path | None, key: str = "") -> None:
        self.path, self.key = path, key
        held = _read(path) if path is not None else {}
        fresh = held.get("key") != key
        self.proxies: dict[str, dict[str, Any]] = {} if fresh else held["proxies"]
        self.nll: dict[str, list[float]] = {} if fresh else held["nll"]
        self.pairs: dict[str, list[list[float]]] = {} if fresh else held["pairs"]
        self.resumed = not fresh and bool(self.proxies or self.nll or self.pairs)

    def summary(self) -> str:
        pairs = sum(len(p) for p in self.pairs.values())
        windows = sum(len(n) for n in self.nll.values())
        return f"{len(self.proxies)} proxies, {windows} window losses and {pairs} speed pairs"

    def finish(self) -> None:
        """The search finished: nothing to resume."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_name(self.path.name + ".partial")
        record = {"key": self.key, "proxies": self.proxies, "nll": self.nll, "pairs": self.pairs}
        staged.write_text(json.dumps(record) + "\n")
        os.replace(staged, self.path)


def _read(path: Path) -> dict[str, Any]:
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) and {"key", "proxies", "nll", "pairs"} <= set(held) else {}

"""Wall time per pipeline stage, so a slow run says where its minutes went (logged on the parent run)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StageClock:
    """Accumulates seconds per stage name; a stage entered several times (one build per variant) adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Seconds a task spent in a stage (measured where it ran; on a cluster, stages overlap)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @property
    def total_s(self) -> float:
        return time.perf_counter() - self._started

    def metrics(self) -> dict[str, float]:
        """`stage_s.<name>` per stage and `wall_s` for the whole run so far (MLflow metric names)."""
        return {
            **{f"stage_s.{name}": round(s, 2) for name, s in self.seconds.items()},
            "wall_s": round(self.total_s, 2),
        }

    def line(self) -> str:
        """'build 95 s · evaluate 80 s · … (total 412 s)': the run's time budget at a glance."""
        parts = " · ".join(f"{name} {s:.0f} s" for name, s in self.seconds.items())
        return f"{parts} (total {self.total_s:.0f} s)"

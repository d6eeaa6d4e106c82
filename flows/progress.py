"""The run's one progress display: every stage's count and ETA, and the work in hand with its own bar.

On a terminal (stderr) it is one live block that the run redraws in place:

    build 4/7  evaluate 3/7  benchmark 0/7  build ETA 1:40  evaluate ETA 2:05   ━━━━━━━━━━━━━━━━━━  0:03:12
      build onnx_int4_mixed                                                ━━━━━━━━━━━━━━━━━━  12/32 0:00:45

Elsewhere (a log, a pipe, `dvc repro` into a file) each finished piece of work is one plain line:

    [ 3:12] build onnx_int4_mixed: 84 s (build 4/7, ETA 1:40; evaluate 3/7)

A stage's ETA is its unfinished work × the mean time of its finished work (so none until one has finished).
Stages overlap (a variant is evaluated while the next one builds), so there is no ETA for the whole run.
Work that runs on a Dask worker reports nowhere: the display lives in the flow's process.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_ACTIVE: RunProgress | None = None  # the display of the run in this process (tasks run in its threads)
_LOCK = threading.Lock()


def clock(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}" if minutes < 60 else f"{minutes // 60}:{minutes % 60:02d}:{rest:02d}"


class RunProgress:
    """Counts per stage (how many pieces of work, how many finished, how long they took) and, on a terminal, the
    live block; `line` writes the plain lines (tests pass a list's append)."""

    def __init__(self, stages: dict[str, int], console: Console, line: Callable[[str], None] | None = None):
        self.totals = dict(stages)
        self.durations: dict[str, list[float]] = {stage: [] for stage in stages}
        self.started = time.monotonic()
        self.console = console
        self.live = line is None and console.is_terminal
        self.line = line or (lambda text: print(text, file=sys.stderr, flush=True))
        self.progress = _bars(console, enabled=self.live, refresh_per_second=2)  # light beside a benchmark
        self.overview = self.progress.add_task(
            self.summary(), total=None
        )  # its clock: the run's elapsed time

    def expect(self, stage: str, count: int) -> None:
        """`stage` will do `count` pieces of work in all (known once earlier stages are done)."""
        with _LOCK:
            self.totals[stage] = count
            self.progress.update(self.overview, description=self.summary())

    def eta(self, stage: str) -> float | None:
        done = self.durations[stage]
        left = self.totals[stage] - len(done)
        return left * sum(done) / len(done) if done and left > 0 else None

    def summary(self) -> str:
        counts = "  ".join(f"{s} {len(d)}/{self.totals[s]}" for s, d in self.durations.items())
        etas = [f"{s} ETA {clock(eta)}" for s in self.totals if (eta := self.eta(s)) is not None]
        return "  ".join([counts, *etas])

    @contextlib.contextmanager
    def item(self, stage: str, name: str) -> Iterator[Callable[[int, int], None]]:
        """One piece of work (`stage` of `name`); yields its `update(done, total)` callback."""
        task = self.progress.add_task(f"  {stage} {name}", total=None)
        start = time.monotonic()
        try:
            yield lambda done, total: self.progress.update(task, completed=done, total=total)
        finally:
            self.progress.remove_task(task)
        seconds = time.monotonic() - start
        with _LOCK:
            if stage not in self.totals:  # work nobody counted in advance (a registered version, a duel)
                self.totals[stage], self.durations[stage] = 0, []
            self.durations[stage].append(seconds)
            self.totals[stage] = max(self.totals[stage], len(self.durations[stage]))
            self.progress.update(self.overview, description=self.summary())
            if not self.live:
                self.line(self._finished(stage, name, seconds))

    def _finished(self, stage: str, name: str, seconds: float) -> str:
        count = f"{stage} {len(self.durations[stage])}/{self.totals[stage]}"
        eta = self.eta(stage)
        others = [f"{s} {len(d)}/{self.totals[s]}" for s, d in self.durations.items() if s != stage]
        state = ", ".join([count + (f", ETA {clock(eta)}" if eta is not None else ""), *others])
        return f"[{clock(time.monotonic() - self.started):>5}] {stage} {name}: {seconds:.0f} s ({state})"


@contextlib.contextmanager
def run_progress(stages: dict[str, int], line: Callable[[str], None] | None = None) -> Iterator[RunProgress]:
    """The run's display while the block runs: `stages` maps each stage to how many pieces of work it will do."""
    global _ACTIVE
    display, previous = RunProgress(stages, Console(stderr=True), line), _ACTIVE
    with display.progress, _log_lines_above(display):
        _ACTIVE = display
        try:
            yield display
        finally:
            _ACTIVE = previous


@contextlib.contextmanager
def _log_lines_above(display: RunProgress) -> Iterator[None]:
    """While the live block is drawn, the console's log lines print above it (through its console) instead of
    into it: Prefect's console handlers hold a rich console of their own on the terminal."""
    import logging

    swapped = []
    if display.live:
        for logger in [logging.getLogger(), *logging.root.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", []):
                if isinstance(getattr(handler, "console", None), Console):
                    swapped.append((handler, handler.console))
                    handler.console = display.progress.console
    try:
        yield
    finally:
        for handler, console in swapped:
            handler.console = console


@contextlib.contextmanager
def progress_bar(stage: str, name: str) -> Iterator[Callable[[int, int], None]]:
    """An `update(done, total)` callback for `stage` of `name`: a row of the run's display when one is open in this
    process, else a transient bar of its own on a terminal (nothing elsewhere)."""
    active = _ACTIVE  # read once: the run's block may close meanwhile in another thread
    if active is not None:
        with active.item(stage, name) as update:
            yield update
        return
    console = Console(stderr=True)
    with _bars(console, enabled=console.is_terminal) as progress:
        task_id = progress.add_task(f"{stage} {name}", total=None)
        yield lambda done, total: progress.update(task_id, completed=done, total=total)


def _bars(console: Console, enabled: bool, refresh_per_second: float = 10) -> Progress:
    """Rows of description, bar, done/total and elapsed time, gone when done (nothing drawn unless `enabled`)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled,
        refresh_per_second=refresh_per_second,
    )

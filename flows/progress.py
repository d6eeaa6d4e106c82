"""Terminal progress bars for long stages (shared by every flow)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """Yield an `update(done, total)` callback drawing a transient bar on stderr (nothing when stderr is not a
    terminal: a log or a pipe gets no bars and no blank lines)."""
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=console,
        disable=not console.is_terminal,
    ) as progress:
        task_id = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task_id, completed=done, total=total)

        yield update

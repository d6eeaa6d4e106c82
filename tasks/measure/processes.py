"""A variant's own process, for measuring it: how it starts (`fresh_process_context`) and what it inherits."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
from pathlib import Path

# What a torch variant's process imports before it can load one: transformers' model code, ~5-10 s on 2 cores
TORCH_PRELOAD = (
    "tasks.measure.forkserver_quiet",  # first: the imports after it print to the command's log file, not the console
    "tasks.measure.benchmark",
    "tasks.engines.pytorch.runtime",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.models.auto.modeling_auto",
)


def fresh_process_context(engine: str) -> multiprocessing.context.BaseContext:
    """How a variant's measuring process (the benchmark's, the search's) starts. A torch variant's is forked from
    one server process per command that imported TORCH_PRELOAD once and ran nothing else (no thread, no model, no
    allocator state), so it starts where a spawned interpreter would be after those imports, without paying them
    again for each variant and trial. Every other engine's is spawned: it never imports that code, which would add
    ~350 MB to its peak."""
    if engine != "torch":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(TORCH_PRELOAD))
    return context


def take_parents_environment(environment: dict[str, str], to_log_file: bool = True) -> None:
    """In the variant's process: its environment is its parent's now (a forked one would have the server's, from
    when that started), and (`to_log_file`) its output goes to the command's log file."""
    from tasks.quiet import output_to_log_file

    os.environ.clear()
    os.environ.update(environment)
    if to_log_file:
        output_to_log_file()


def peak_rss_mb() -> float:
    """High-water resident memory of this process image.

    VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over fork and exec, so a spawned child would
    report its parent's peak (the evaluation model) instead of its own.
    """
    return proc_status_kib("VmHWM") / 1024


def reset_peak_rss() -> None:
    """Start VmHWM afresh from the current resident memory (Linux: "5" to clear_refs); a no-op where refused."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def rss_mb() -> float:
    return proc_status_kib("VmRSS") / 1024


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; peak memory needs Linux")

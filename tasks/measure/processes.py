"""A variant's own process, for measuring it: how it starts (`fresh_process_context`) and what it inherits."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os

# What a torch variant's process imports before it can load one: transformers' model code, ~5-10 s on 2 cores
TORCH_PRELOAD = (
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

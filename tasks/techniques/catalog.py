"""Which techniques exist: the built-in technique modules, the installed plug-ins (the `llmopt.techniques`
entry-point group) and the modules named in `$LLMOPT_TECHNIQUES`, imported so that each registers itself with the
contract in tasks/techniques/registry.py. The recipe schema (tasks/params.py) is built from what this loads, once
per process; `make techniques-table` writes the docs' technique table from it.

The catalog sits above the techniques (it imports them) and the registry below them (they import it), so neither
imports the other's side."""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from pathlib import Path

from tasks.techniques.registry import TECHNIQUES, Technique, write_table_into

# Modules under tasks.techniques that register the built-in techniques, in the order the schema lists them.
BUILT_IN = ("prune", "distill", "quantize", "onnx_export", "gguf_export")
ENTRY_POINTS = "llmopt.techniques"
ENVIRONMENT = "LLMOPT_TECHNIQUES"
LOAD_PROBLEMS: list[str] = []  # plug-in modules that failed to import (load_config reports the first)


def load() -> dict[str, Technique]:
    """Import the built-in techniques, then the installed and the named ones; returns the registry."""
    for module in BUILT_IN:
        importlib.import_module(f"tasks.techniques.{module}")
    for entry in metadata.entry_points(group=ENTRY_POINTS):
        _import(entry.value.split(":")[0], f"entry point {entry.name} ({ENTRY_POINTS})")
    for module in filter(None, (part.strip() for part in os.environ.get(ENVIRONMENT, "").split(","))):
        _import(module, f"${ENVIRONMENT}")
    return TECHNIQUES


def _import(module: str, origin: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        problem = f"{origin}: technique module {module} cannot be imported: {exc}"
        if problem not in LOAD_PROBLEMS:
            LOAD_PROBLEMS.append(problem)


if __name__ == "__main__":  # `make techniques-table`; the table's page is docs/techniques.md unless named
    import sys

    load()
    write_table_into(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/techniques.md"))

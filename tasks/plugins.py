"""Plug-ins: modules outside llmopt that register techniques, quantization methods, weights formats, engines or
wire APIs with the registries below them. Installed ones name themselves in the `llmopt.techniques` entry-point
group; `$LLMOPT_TECHNIQUES` names more (comma-separated import names). Each module is imported once per process;
one that fails to import is recorded (the configuration loader reports the first) rather than raised, so a broken
plug-in is one line naming it."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from importlib import metadata

ENTRY_POINTS = "llmopt.techniques"
ENVIRONMENT = "LLMOPT_TECHNIQUES"
LOAD_PROBLEMS: list[str] = []  # plug-in modules that failed to import (load_config reports the first)


_LOADED: set[str] = set()  # the `$LLMOPT_TECHNIQUES` values already loaded in this process


def load_plugins() -> None:
    """Import the installed plug-ins, then the ones `$LLMOPT_TECHNIQUES` names: once per process and value of the
    variable (the entry-point scan reads every installed distribution's metadata)."""
    named = os.environ.get(ENVIRONMENT, "")
    if named in _LOADED:
        return
    _LOADED.add(named)
    for entry in metadata.entry_points(group=ENTRY_POINTS):
        _import(entry.value.split(":")[0], f"entry point {entry.name} ({ENTRY_POINTS})")
    for module in filter(None, (part.strip() for part in named.split(","))):
        _import(module, f"${ENVIRONMENT}")


def _import(module: str, origin: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        problem = f"{origin}: technique module {module} cannot be imported: {exc}"
        if problem not in LOAD_PROBLEMS:
            LOAD_PROBLEMS.append(problem)


def load_with_plugins(modules: Iterable[str]) -> None:
    """Import a registry's built-in `modules` (each registers itself), then the plug-ins: what every catalog does."""
    for module in modules:
        importlib.import_module(module)
    load_plugins()

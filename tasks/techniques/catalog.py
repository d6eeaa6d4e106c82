"""Which techniques exist: the built-in technique modules, and the plug-ins (tasks/plugins.py: the `llmopt.techniques`
entry-point group and the modules named in `$LLMOPT_TECHNIQUES`), imported so that each registers itself with the
contract in tasks/techniques/registry.py. The recipe schema (tasks/params.py) is built from what this loads, once
per process; `make techniques-table` writes the docs' technique table from it.

The catalog sits above the techniques (it imports them) and the registry below them (they import it), so neither
imports the other's side."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from tasks.engines import BUILT_IN as ENGINES
from tasks.plugins import load_with_plugins
from tasks.techniques.registry import TECHNIQUES, Technique, write_table_into

# The modules that register the built-in techniques, in the order the schema lists them: the transforms and
# quantize here, then each built-in engine's export technique (tasks/engines/<engine>/export.py, where it has one).
BUILT_IN = (
    "tasks.techniques.prune",
    "tasks.techniques.distill",
    "tasks.techniques.quantize.step",
    *(
        f"tasks.engines.{engine}.export"
        for engine in ENGINES
        if importlib.util.find_spec(f"tasks.engines.{engine}.export") is not None
    ),
)


def load() -> dict[str, Technique]:
    """Import the built-in techniques, then the plug-ins (tasks/plugins.py); returns the registry."""
    load_with_plugins(BUILT_IN)
    return TECHNIQUES


if __name__ == "__main__":  # `make techniques-table`; the table's page is docs/techniques.md unless named
    import sys

    load()
    write_table_into(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/techniques.md"))

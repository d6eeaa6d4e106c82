"""The `llmopt` command line: thin commands over the flows (one module per group), their rendering apart
(`render`), and one session object per command that sets the environment up and turns user errors into one line.
"""

from __future__ import annotations

from flows.cli.app import app

# Importing a command module registers its commands; `--help` lists them in this order.
# isort: off
from flows.cli import pipeline_commands, serving_commands, service_commands  # noqa: F401
# isort: on


def main() -> None:
    """Console-script entry point."""
    app()

"""The `llmopt` command line: thin commands over the flows (one module per group), their rendering apart
(`render`), and one session object per command that sets the environment up and turns user errors into one line.
"""

from __future__ import annotations

import inspect

import typer

from flows.cli.app import app

# Importing a command module registers its commands; `--help` lists them in this order.
# isort: off
from flows.cli import pipeline_commands, serving_commands, service_commands  # noqa: F401
# isort: on


def reflowed(text: str) -> str:
    """A docstring as `--help` should print it: paragraphs (split at blank lines) joined into one line each, for the
    terminal to wrap; the source's own line breaks would otherwise show as ragged breaks mid-sentence."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n"))


def _reflow_help(typer_app: typer.Typer) -> None:
    for command in typer_app.registered_commands:
        text = command.help or (command.callback.__doc__ if command.callback else None)
        if text:
            command.help = reflowed(text)
    for group in typer_app.registered_groups:
        _reflow_help(group.typer_instance)


_reflow_help(app)


def main() -> None:
    """Console-script entry point."""
    app()

"""The `llmopt` Typer application and the options every command shares."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="llmopt: optimize a causal LM, measure accuracy and speed honestly, register and serve the winner.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="Pipeline settings (YAML).")]
DebugOption = Annotated[
    bool,
    typer.Option("--debug", help="Show everything on the console: library logs, Prefect's, full tracebacks."),
]

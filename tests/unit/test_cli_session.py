"""The command session: a params file read twice by one command names each former spelling once."""

from __future__ import annotations

import os

from flows.cli.session import CommandSession


def test_a_deprecation_line_is_printed_once_per_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the session's environment defaults stay here
    params = tmp_path / "params.yaml"
    params.write_text("variants:\n  baseline: {}\n  ds:\n    runtime: {engine: deepspeed}\n")
    session = CommandSession(debug=True)  # debug: leave the libraries' loggers and warnings as they are
    session.setup(params)
    session.setup(params)  # `llmopt promote` reads its params twice
    lines = [line for line in capsys.readouterr().err.splitlines() if "deprecated:" in line]
    assert lines == [
        "deprecated: params.yaml: variants.ds.runtime: engine: deepspeed → wrapper: deepspeed (the former "
        "spelling still works, for now)"
    ]

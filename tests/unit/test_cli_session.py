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


def test_the_environment_keeps_inductors_kernels_in_the_work_folder_unless_the_user_set_them(
    tmp_path, monkeypatch
):
    """A cuda target's compiled decode steps: their kernels kept with the project (reused by the next process and
    run), where a user's own TORCHINDUCTOR_CACHE_DIR is left alone."""
    from flows.cli.session import _configure_environment

    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the function sets stays in this test
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    _configure_environment(tmp_path, debug=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/elsewhere"
    _configure_environment(tmp_path, debug=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"

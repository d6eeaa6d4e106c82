"""`llmopt run` on bad input: one clear line, non-zero exit, no traceback, registry untouched."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.integration.project import make_project, run, tiny_params


def registered_models(root: Path) -> int:
    database = root / "mlflow.db"
    if not database.exists():
        return 0
    with sqlite3.connect(database) as connection:
        return connection.execute("select count(*) from registered_models").fetchone()[0]


def run_failing(root: Path) -> tuple[int, str]:
    result = run(root, "llmopt", "run", check=False, timeout=600)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, output
    return result.returncode, error_lines[0]


def test_unknown_params_key(tmp_path, tiny_model_dir, corpus_dir):
    params = tiny_params(tiny_model_dir, corpus_dir, evaluate={"windw": 32})
    root = make_project(tmp_path / "p", params, with_dvc=False)
    code, line = run_failing(root)
    assert code == 2
    assert "evaluate.windw: unknown key (did you mean 'window'?)" in line
    assert registered_models(root) == 0


def test_wrong_type(tmp_path, tiny_model_dir, corpus_dir):
    params = tiny_params(tiny_model_dir, corpus_dir, benchmark={"repeats": "three"})
    root = make_project(tmp_path / "p", params, with_dvc=False)
    code, line = run_failing(root)
    assert code == 2
    assert "benchmark.repeats: Input should be a valid integer, got 'three'" in line


def test_missing_local_model(tmp_path, corpus_dir):
    params = tiny_params(tmp_path / "no-such-model", corpus_dir)
    root = make_project(tmp_path / "p", params, with_dvc=False)
    code, line = run_failing(root)
    assert code == 2
    assert line.endswith(f"model.source: local model folder {tmp_path / 'no-such-model'} does not exist")
    assert not (root / ".llmopt").exists()


def test_every_pre_flight_problem_is_named_at_once_before_anything_starts(tmp_path, tiny_model_dir):
    params = tiny_params(
        tiny_model_dir, tmp_path / "no-such-corpus", tracking={"uri": "ftp://example.org/mlflow"}
    )
    root = make_project(tmp_path / "p", params, with_dvc=True)
    run(root, "dvc", "remote", "default", "--unset")
    code, line = run_failing(root)
    assert code == 2 and "3 problems, nothing started" in line
    assert f"data.source: {tmp_path / 'no-such-corpus'} does not exist" in line
    assert "tracking.uri: scheme ftp:// is not supported" in line and "DVC: no default remote" in line
    assert not (root / ".llmopt").exists() and registered_models(root) == 0


def test_an_unreachable_tracking_server_is_refused_before_work_starts(tmp_path, tiny_model_dir, corpus_dir):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    params = tiny_params(tiny_model_dir, corpus_dir, tracking={"uri": f"http://127.0.0.1:{port}"})
    root = make_project(tmp_path / "p", params, with_dvc=False)
    code, line = run_failing(root)
    assert code == 2 and f"tracking.uri: nothing answers at 127.0.0.1:{port}" in line
    assert not (root / ".llmopt").exists()


@pytest.mark.slow
def test_empty_corpus_stops_before_anything_is_registered(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty-corpus"
    empty.mkdir()
    root = make_project(tmp_path / "p", tiny_params(tiny_model_dir, empty), with_dvc=False)
    code, line = run_failing(root)
    assert code == 1
    assert "data validation failed: corpus-calibration: expect_table_row_count_to_be_between" in line
    assert registered_models(root) == 0
    assert not (root / ".llmopt" / "variants").exists()

"""The rule that no test skips silently (tests/conftest.py), applied to a throwaway suite in its own pytest run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import pytest

pytest.importorskip("{module}")


def test_hidden_by_the_module_skip():
    pass
"""

CUDA = """
import pytest


@pytest.mark.cuda
def test_a_gpu_test(device="cuda"):
    pass


@pytest.mark.parametrize("device", ["cuda"])  # "cuda" among its keywords, as a cuda-marked test's
def test_a_gpu_path_skipping_for_another_reason(device):
    pytest.skip("{reason}")
"""


def guarded_run(tmp_path: Path, name: str, text: str) -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(text)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
    )


def test_a_module_skipped_at_collection_fails_the_run(tmp_path):
    result = guarded_run(tmp_path, "test_lost_import.py", SUITE.format(module="no_such_module_llmopt"))
    assert result.returncode == 1, result.stdout
    assert "skips outside the allow-list: the run fails" in result.stdout
    assert "test_lost_import.py (collection)" in result.stdout and "no_such_module_llmopt" in result.stdout


def test_a_cuda_test_skipping_for_another_reason_than_no_gpu_fails_the_run(tmp_path):
    """Only the missing GPU is an allowed reason (here the marked test skips for it: no GPU is visible); a test
    carrying the `cuda` keyword that skips because, say, an import failed fails the run."""
    failing = guarded_run(tmp_path, "test_gpu.py", CUDA.format(reason="flash-attn is not importable"))
    assert failing.returncode == 1, failing.stdout
    assert (
        "test_a_gpu_path_skipping_for_another_reason[cuda]: Skipped: flash-attn is not importable"
        in failing.stdout
    )
    assert "test_a_gpu_test:" not in failing.stdout.split("skips outside the allow-list")[-1]


def test_a_module_that_imports_runs_and_a_missing_gpu_is_the_allowed_skip(tmp_path):
    result = guarded_run(tmp_path, "test_fine.py", SUITE.format(module="json"))
    assert result.returncode == 0, result.stdout
    assert "skips outside the allow-list" not in result.stdout

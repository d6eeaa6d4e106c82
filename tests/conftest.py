"""Shared fixtures (offline environment, a synthetic corpus, a tiny model random and trained, built once per
session) and the rule that no test skips silently: a skip outside SKIPS_ALLOWED fails the run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.factories import build_tiny_llama, synthetic_sentences, train_tiny_llama, write_corpus

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), synthetic_sentences(400, seed=99))


@pytest.fixture(scope="session")
def trained_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained on the synthetic sentences (seeded, ~5 s once per run): its loss is far below
    uniform, so every accuracy test of a technique can tell a working quantizer from a no-op or a destroyer."""
    folder = tmp_path_factory.mktemp("tiny-llama-trained")
    return train_tiny_llama(tiny_model_dir, folder, synthetic_sentences(1500, seed=7))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices gain nothing from threads; on shared cores extra threads make every step ~5x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Markers whose tests may skip (where the machine cannot run them); any other skip fails the run, so a missing
# service, an unmounted tmpfs or a lost import never hides coverage behind a line in the summary.
SKIPS_ALLOWED = {"cuda": "needs an NVIDIA GPU"}
_unexpected_skips: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--planted-quantizer",
        choices=["noop", "scramble", "four_bit"],
        default=None,
        help="build tests/model/test_techniques.py's variants with a broken quantizer (its tests must then fail)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_tests = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_tests:
        import torch

        if not torch.cuda.is_available():
            for item in cuda_tests:
                item.add_marker(pytest.mark.skip(reason=_allowed_reason("cuda")))


def _allowed_reason(marker: str) -> str:
    """The one reason a test marked `marker` may skip for (see pytest_collection_modifyitems)."""
    return f"{marker}: {SKIPS_ALLOWED[marker]}, none is visible"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A skip counts as allowed only with its marker's own reason: a `cuda` test skipping for anything but a
    missing GPU (a failed import, a broken driver) fails the run like any other skip."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if not any(marker in report.keywords and _allowed_reason(marker) in reason for marker in SKIPS_ALLOWED):
        _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped while it is collected (a module-level `pytest.importorskip`) hides all its tests: it fails
    the run too."""
    if report.skipped:
        _unexpected_skips.append(f"{report.nodeid} (collection): {_reason(report)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips and os.environ.get("LLMOPT_ALLOW_SKIPS") != "1":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _unexpected_skips:
        allowed = os.environ.get("LLMOPT_ALLOW_SKIPS") == "1"
        terminalreporter.section(
            "skips outside the allow-list"
            + (" (allowed by LLMOPT_ALLOW_SKIPS=1)" if allowed else ": the run fails")
        )
        for line in _unexpected_skips:
            terminalreporter.line(line)

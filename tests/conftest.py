"""Shared fixtures: offline environment, a synthetic corpus and a tiny model built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.factories import build_tiny_llama, synthetic_sentences, write_corpus

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), synthetic_sentences(400, seed=99))


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

"""Fixtures shared by the model tests: the tiny model as a prepared base, and its baseline variant built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.build.optimize import build_variant
from tasks.config import VariantConfig
from tasks.engines import Runtime, load_runtime
from tasks.inputs.load import PreparedBase
from tasks.storage import folder_sha256


@pytest.fixture(scope="session")
def tiny_base(tiny_model_dir: Path) -> PreparedBase:
    """The tiny model as the pipeline's load stage hands it over."""
    return PreparedBase(tiny_model_dir, folder_sha256(tiny_model_dir), "tiny")


@pytest.fixture(scope="session")
def baseline_dir(tiny_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's fp32 baseline variant folder (manifest included)."""
    folder = tmp_path_factory.mktemp("tiny-baseline") / "baseline"
    build_variant("baseline", VariantConfig(), tiny_base, "data-hash", folder)
    return folder


@pytest.fixture(scope="session")
def baseline_runtime(baseline_dir: Path) -> Runtime:
    """The baseline loaded through the Runtime, one thread (tiny matrices gain nothing from more)."""
    return load_runtime(baseline_dir, threads=1)

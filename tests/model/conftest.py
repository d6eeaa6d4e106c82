"""Fixtures shared by the model tests: the tiny model (random, and trained) as a prepared base, its baseline variant,
and every technique built once on the trained model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.config import TargetConfig
from tasks.engines import Runtime, load_runtime
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.factories import TINY_ENGINE_RECIPES
from tests.techniques import CALIBRATION, CLAIMS, FP32_RECIPES, Reference, planted_quantizer


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
def tiny_engine_dir(
    tiny_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """engine name → the tiny model's full-precision variant folder in that engine, built once per session on first
    use (read-only: a test that damages a variant builds its own)."""
    built: dict[str, Path] = {}

    def folder(engine: str) -> Path:
        if engine not in built:
            path = tmp_path_factory.mktemp("tiny-engines") / engine
            build_variant(
                engine, VariantConfig.model_validate(TINY_ENGINE_RECIPES[engine]), tiny_base, "d", path
            )
            built[engine] = path
        return built[engine]

    return folder


@pytest.fixture(scope="session")
def baseline_runtime(baseline_dir: Path) -> Runtime:
    """The baseline loaded through the Runtime, one thread (tiny matrices gain nothing from more)."""
    return load_runtime(baseline_dir, TargetConfig(threads=1))


@pytest.fixture(scope="session")
def trained_base(trained_model_dir: Path) -> PreparedBase:
    return PreparedBase(trained_model_dir, folder_sha256(trained_model_dir), "trained")


@pytest.fixture(scope="session")
def trained_variants(
    trained_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Path]:
    """The fp32 references and every technique of tests/techniques.py's CLAIMS, built once on the trained model
    (every quantizer replaced by a planted broken one under `--planted-quantizer`). Read-only: a test that damages
    or rebuilds a variant builds its own."""
    import torch

    root = tmp_path_factory.mktemp("trained-variants")
    recipes = FP32_RECIPES | {name: claim.recipe for name, claim in CLAIMS.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    try:
        planted = request.config.getoption("--planted-quantizer")
        with pytest.MonkeyPatch.context() as monkeypatch, planted_quantizer(planted, monkeypatch):
            for name, recipe in recipes.items():
                variant = VariantConfig.model_validate(recipe)
                build_variant(name, variant, trained_base, "data-hash", root / name, CALIBRATION)
    finally:
        torch.set_num_threads(threads)
    return {name: root / name for name in recipes}


@pytest.fixture(scope="session")
def reference(trained_variants: dict[str, Path]) -> Reference:
    """The trained model's fp32 answers on the held-out windows."""
    return Reference.of(load_runtime(trained_variants["baseline"], TargetConfig(threads=1)))

"""The optimize stage as `llmopt run` calls it reuses an intact variant and rebuilds a damaged one, even when the
damage keeps the file's size and modification time (only its content hash can tell)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tasks.local_files
from flows.cluster import Stored, Workspace
from flows.stages import Inputs, build_task
from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.inputs.data import write_splits
from tasks.inputs.load import PreparedBase
from tasks.local_files import file_sha256, folder_sha256
from tasks.params import VariantConfig
from tests.factories import synthetic_sentences

BF16 = VariantConfig.model_validate({"runtime": {"dtype": "bfloat16"}})


@pytest.fixture
def remembered_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hash cache of the test's own that remembers every hash at once, as it does for a variant built more than
    two seconds before the next run: the rebuild must not come from a cache that never held the hash."""
    monkeypatch.setenv("LLMOPT_HASH_CACHE", str(tmp_path / "file-hashes.sqlite"))
    monkeypatch.setattr(tasks.local_files, "_RACY_NS", 0)


def test_the_run_s_optimize_stage_rebuilds_a_variant_damaged_keeping_its_size_and_mtime(
    tiny_base: PreparedBase, tmp_path: Path, remembered_hashes: None
):
    splits = {"calibration": synthetic_sentences(8, seed=1), "evaluation": synthetic_sentences(8, seed=2)}
    data = write_splits(splits, tmp_path / "data")
    inputs = Inputs(tiny_base, Stored(tiny_base.path), data, Stored(tmp_path / "data"))
    space = Workspace(tmp_path / "work")
    built = build_task.fn("bf16", BF16, inputs, space)
    folder = tmp_path / "work" / "variants" / "bf16"
    weights = folder / "model.safetensors"
    runtime = load_runtime(folder, TargetConfig(threads=1))
    ids = runtime.encode("The river walks the stone near the garden")
    scores = runtime.score([ids])
    before = weights.stat()
    assert build_task.fn("bf16", BF16, inputs, space).manifest == built.manifest  # intact: reused ...
    assert weights.stat().st_mtime_ns == before.st_mtime_ns  # ... not rewritten

    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(byte ^ 0xFF for byte in data[middle : middle + 4096])
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # `touch -r`: only ctime shows the write
    damaged = weights.stat()
    assert (damaged.st_ino, damaged.st_size, damaged.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert file_sha256(weights) != built.manifest.files["model.safetensors"]

    rebuilt = build_task.fn("bf16", BF16, inputs, space)
    assert rebuilt.manifest.content_hash == built.manifest.content_hash
    assert folder_sha256(folder, exclude=("manifest.json",)) == built.manifest.content_hash
    assert file_sha256(weights) == built.manifest.files["model.safetensors"]
    assert load_runtime(folder, TargetConfig(threads=1)).score([ids]) == scores

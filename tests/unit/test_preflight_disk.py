"""The pre-flight disk check: the variants still to build, each counted at the base model's size, must fit in
the free space of the folder they go to.

The base model's weights are a sparse file: its size (what the check reads) is three quarters of the free space
on the test's own disk while it occupies no blocks, so the real free space decides without filling anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.errors import ConfigError
from tasks.params import Config
from tasks.preflight import check_disk_space

VARIANTS = {
    "baseline": {},
    "bf16": {"runtime": {"dtype": "bfloat16"}},
    "int8": {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}]},
}


@pytest.fixture
def workdir(tmp_path: Path):
    """A work folder whose base model is as large as 3/4 of the free space and whose baseline is built."""
    work = tmp_path / ".llmopt"
    (work / "base").mkdir(parents=True)
    (work / "variants" / "baseline").mkdir(parents=True)
    (work / "variants" / "baseline" / "manifest.json").write_text("{}")
    weights = work / "base" / "model.safetensors"
    with weights.open("wb") as handle:
        handle.truncate(int(shutil.disk_usage(work / "variants").free * 0.75))
    assert weights.stat().st_blocks * 512 < 1_000_000  # sparse: this test fills no disk
    yield work
    weights.unlink()


def test_disk_check_refuses_in_one_line_naming_the_folder_and_the_gb_needed_when_variants_do_not_fit(
    workdir, tmp_path
):
    config = Config.model_validate({"variants": VARIANTS})
    needed = 2 * (workdir / "base" / "model.safetensors").stat().st_size  # bf16 and int8 are not built yet
    with pytest.raises(ConfigError) as refused:
        check_disk_space(config, tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"disk: 2 variants to build need about {needed / 1e9:.1f} GB in ")
    assert f" in {workdir / 'variants'}, " in message and message.endswith(" GB free")


def test_disk_check_passes_when_the_variants_left_to_build_fit(workdir, tmp_path):
    """Same disk, same base model: two variants to build do not fit; with bf16 built too, one does."""
    config = Config.model_validate({"variants": VARIANTS})
    with pytest.raises(ConfigError, match="2 variants to build"):
        check_disk_space(config, tmp_path)
    (workdir / "variants" / "bf16").mkdir()
    (workdir / "variants" / "bf16" / "manifest.json").write_text("{}")
    assert check_disk_space(config, tmp_path) is None


def test_disk_check_waits_for_the_first_run_when_the_base_model_size_is_not_known(tmp_path):
    assert check_disk_space(Config.model_validate({"variants": VARIANTS}), tmp_path) is None

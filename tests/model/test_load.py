"""The load stage: a local model folder is keyed by its content, so weights edited in place are noticed."""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.config import ModelConfig
from tasks.inputs.load import prepare_base_model


def test_a_local_source_edited_in_place_is_prepared_again_and_an_unchanged_one_is_reused(
    tiny_model_dir, tmp_path
):
    import torch
    from transformers import AutoModelForCausalLM

    source = Path(shutil.copytree(tiny_model_dir, tmp_path / "source"))
    cfg = ModelConfig(source=str(source))
    first = prepare_base_model(cfg, tmp_path / "base")
    weights = tmp_path / "base" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert prepare_base_model(cfg, tmp_path / "base").content_hash == first.content_hash
    assert weights.stat().st_mtime_ns == written  # reused, not rewritten

    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(source)  # same path, other weights
    edited = prepare_base_model(cfg, tmp_path / "base")
    assert edited.content_hash != first.content_hash

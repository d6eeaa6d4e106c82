"""The load stage: a local model folder is keyed by its content, so weights edited in place are noticed."""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.config import ModelConfig
from tasks.inputs.load import prepare_base_model, save_tokenizer


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


def test_saved_tokenizers_do_not_record_how_they_were_loaded(tiny_model_dir, tmp_path):
    """HF_HUB_OFFLINE makes transformers load with local_files_only=True and write that into tokenizer_config.json:
    the same model's bytes (and every variant hash) would depend on the shell the run started from."""
    from transformers import AutoTokenizer

    saved = []
    for offline in (True, False):
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=offline)
        save_tokenizer(tokenizer, tmp_path / str(offline))
        saved.append((tmp_path / str(offline) / "tokenizer_config.json").read_text())
    assert saved[0] == saved[1]
    assert "local_files_only" not in saved[0]
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "True")
    assert reloaded("a tiny test").input_ids == tokenizer("a tiny test").input_ids

"""Steps compose: prune(structured) → quantize(int8) and distill → quantize(int8) build, reload and generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.manifest import read_manifest
from tasks.errors import BuildError, ConfigError
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.factories import synthetic_sentences

PRUNE_THEN_INT8 = {
    "steps": [
        {"prune": {"method": "structured", "mlp_fraction": 0.25, "head_groups": 1, "heal_steps": 3}},
        {"quantize": {"method": "torch_dynamic_int8"}},
    ]
}
DISTILL_THEN_INT8 = {
    "steps": [
        {
            "distill": {
                "keep_every": 2,
                "steps": 4,
                "batch_size": 2,
                "sequence_tokens": 32,
                "checkpoint_every": 2,
            }
        },
        {"quantize": {"method": "torch_dynamic_int8"}},
    ]
}


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> PreparedBase:
    """The tiny model with 4 layers, so that distillation has layers to drop."""
    folder = tmp_path_factory.mktemp("four-layers")
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return PreparedBase(folder, folder_sha256(folder), "four-layers")


def test_pruned_model_exports_to_onnx_and_gguf_and_scores_like_its_torch_twin(base, tmp_path):
    calibration = [" ".join(synthetic_sentences(20, seed=s)) for s in range(4)]
    prune = {"prune": {"method": "structured", "mlp_fraction": 0.5, "importance": "activation"}}
    recipes = {
        "torch": [prune],
        "onnx": [prune, {"onnx_genai": {"precision": "fp32"}}],
        "gguf": [prune, {"llama_cpp": {"type": "F32"}}],
    }
    for name, steps in recipes.items():
        build_variant(
            name, VariantConfig.model_validate({"steps": steps}), base, "d", tmp_path / name, calibration
        )
    torch_runtime, onnx_runtime, gguf_runtime = (
        load_runtime(tmp_path / n, TargetConfig(threads=1)) for n in recipes
    )
    ids = torch_runtime.encode("The river walks the stone near the garden")
    assert (onnx_runtime.manifest.engine, gguf_runtime.manifest.engine) == ("onnxruntime-genai", "llama.cpp")
    assert onnx_runtime.score([ids])[0][0] == pytest.approx(torch_runtime.score([ids])[0][0], rel=1e-4)
    assert gguf_runtime.score([ids])[0][0] == pytest.approx(torch_runtime.score([ids])[0][0], rel=1e-3)


@pytest.mark.parametrize(("recipe", "layers"), [(PRUNE_THEN_INT8, 4), (DISTILL_THEN_INT8, 3)])
def test_float_steps_then_int8_build_reload_and_generate(base, tmp_path, recipe, layers):
    calibration = [" ".join(synthetic_sentences(20, seed=s)) for s in range(4)]
    manifest = build_variant(
        "v", VariantConfig.model_validate(recipe), base, "d", tmp_path / "v", calibration
    )
    runtime = load_runtime(tmp_path / "v", TargetConfig(threads=1))
    assert manifest.weights_format == "torch-dynamic-int8"
    assert runtime.model.config.num_hidden_layers == layers
    full = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(base.path).parameters())
    assert manifest.parameters < full
    ids = runtime.encode("The river walks the stone near the garden")
    assert len(runtime.generate([ids], 5, stop_at_eos=False)[0]) == 5
    curve = "heal_loss" if "prune" in recipe["steps"][0] else "distill_loss"
    assert len(read_manifest(tmp_path / "v").training[curve]) in (3, 4)
    assert not (tmp_path / "v.checkpoint").exists()  # checkpoints go once the variant is complete


def test_pruned_model_has_the_shapes_its_config_promises(base, tmp_path):
    recipe = {"steps": [{"prune": {"method": "structured", "mlp_fraction": 0.5, "importance": "magnitude"}}]}
    build_variant("p", VariantConfig.model_validate(recipe), base, "d", tmp_path / "p")
    model = load_runtime(tmp_path / "p", TargetConfig(threads=1)).model
    assert model.config.intermediate_size == 64
    assert all(layer.mlp.up_proj.weight.shape == (64, 64) for layer in model.model.layers)


def test_calibrated_step_without_calibration_text_is_a_clear_error(base, tmp_path):
    with pytest.raises(BuildError, match="needs the calibration split"):
        build_variant("d", VariantConfig.model_validate(DISTILL_THEN_INT8), base, "d", tmp_path / "d")
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.partial").exists()


def test_a_step_setting_the_model_cannot_take_is_a_config_error_naming_the_variant(base, tmp_path):
    too_many = {"steps": [{"prune": {"method": "structured", "head_groups": 2, "importance": "magnitude"}}]}
    with pytest.raises(ConfigError, match=r"variants\.p\.steps: prune\.head_groups: "):
        build_variant("p", VariantConfig.model_validate(too_many), base, "d", tmp_path / "p")

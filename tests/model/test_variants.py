"""Behaviour of each variant recipe on the trained tiny Llama: it builds, reloads through the Runtime, generates and
scores; the same graph agrees across engines (how far each technique moves the model: test_techniques.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tasks.config import EvaluateConfig, TargetConfig
from tasks.engines import load_runtime
from tasks.engines.manifest import read_manifest
from tasks.errors import DataValidationError
from tasks.local_files import folder_sha256
from tasks.measure.evaluate import evaluate_perplexity, evaluate_variant
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.techniques import CLAIMS, FP32_RECIPES

# Recipes that run the fp32 graph in another engine must agree with torch fp32 to float rounding (mean per-token
# NLL); how far each quantizer may move the model is checked in test_techniques.py, with controls.
SAME_GRAPH_TOLERANCE = {"baseline": 1e-5, "onnx_fp32": 1e-4}
NAMES = [*FP32_RECIPES, *CLAIMS]
PROMPT = "The river walks the stone near the garden 12. The train finds the book"


@pytest.fixture(scope="module")
def variants(trained_variants: dict[str, Path]) -> dict[str, Path]:
    return trained_variants


@pytest.mark.parametrize("name", NAMES)
def test_variant_reloads_with_the_same_tokenizer_generates_and_scores_every_token(variants, name):
    reference = load_runtime(variants["baseline"], TargetConfig(threads=1))
    runtime = load_runtime(variants[name], TargetConfig(threads=1))
    ids = runtime.encode(PROMPT)
    assert ids == reference.encode(PROMPT)
    (generated,) = runtime.generate([ids], max_new_tokens=5, stop_at_eos=False)
    assert len(generated) == 5
    ((nll, count),) = runtime.score([ids])
    ((ref_nll, ref_count),) = reference.score([ids])
    assert count == ref_count == len(ids) - 1 and math.isfinite(nll)
    if name in SAME_GRAPH_TOLERANCE:
        assert abs(nll - ref_nll) / count <= SAME_GRAPH_TOLERANCE[name]


def test_onnx_fp32_generates_exactly_what_torch_fp32_generates(variants):
    torch_runtime, onnx_runtime = (
        load_runtime(variants[n], TargetConfig(threads=1)) for n in ("baseline", "onnx_fp32")
    )
    prompt = torch_runtime.encode(PROMPT)
    assert onnx_runtime.manifest.engine == "onnxruntime-genai"
    assert onnx_runtime.generate([prompt], 12, stop_at_eos=False) == torch_runtime.generate(
        [prompt], 12, stop_at_eos=False
    )


@pytest.mark.parametrize("name", ["baseline", "torch_dynamic_int8", "onnx_int8"])
def test_batched_generation_gives_each_prompt_its_own_continuation_in_order(variants, name):
    runtime = load_runtime(variants[name], TargetConfig(threads=1))
    first, second = runtime.encode("The river walks the stone near the garden"), runtime.encode(PROMPT)
    prompts = [first, second, first, second[:-1], second]
    one_by_one = [runtime.generate([p], 6, stop_at_eos=False)[0] for p in prompts]
    assert runtime.generate(prompts, 6, stop_at_eos=False) == one_by_one
    assert one_by_one[0] != one_by_one[1]  # the prompts lead somewhere different, so order is checked


def test_agreement_is_total_for_the_same_graph_and_reported_for_every_variant(variants):
    texts = [
        f"{PROMPT} {i} and then the river finds the quiet garden." for i in range(3)
    ]  # one cloze item each
    cfg = EvaluateConfig(
        window=16, max_tokens=64, agreement_prompts=3, agreement_prompt_tokens=8, agreement_new_tokens=6
    )
    baseline = evaluate_variant(load_runtime(variants["baseline"], TargetConfig(threads=1)), texts, cfg, None)
    assert baseline.agreement.token_agreement == 1.0 and baseline.agreement.prompts == 3
    assert len(baseline.cloze.correct) == 3
    onnx = evaluate_variant(
        load_runtime(variants["onnx_fp32"], TargetConfig(threads=1)), texts, cfg, baseline.continuations
    )
    assert onnx.agreement.exact_match == 1.0
    assert onnx.cloze.correct == baseline.cloze.correct


def test_evaluation_text_without_cloze_items_is_refused(variants):
    cfg = EvaluateConfig(window=16, max_tokens=64, agreement_prompts=1, agreement_new_tokens=2)
    with pytest.raises(DataValidationError, match="no cloze items"):
        evaluate_variant(
            load_runtime(variants["baseline"], TargetConfig(threads=1)),
            ["numbers only 1 2 3 4 5 6 7 8 9."],
            cfg,
            None,
        )


def test_manifest_records_recipe_sizes_and_hashes(variants):
    fp32, bf16, int8 = (read_manifest(variants[n]) for n in ("baseline", "bf16", "torch_dynamic_int8"))
    assert fp32.parameters == bf16.parameters == int8.parameters > 50_000
    assert bf16.size_bytes < fp32.size_bytes
    assert (fp32.weights_format, int8.weights_format) == ("hf-safetensors", "torch-dynamic-int8")
    assert int8.recipe["steps"] == [{"quantize": {"method": "torch_dynamic_int8"}}]
    assert len({fp32.build_key, bf16.build_key, int8.build_key}) == 3


def test_unchanged_variant_is_reused_and_a_corrupted_one_rebuilt(tiny_base, tmp_path):
    folder, recipe = tmp_path / "bf16", VariantConfig.model_validate(CLAIMS["bf16"].recipe)
    build_variant("bf16", recipe, tiny_base, "data-hash", folder)
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_variant("bf16", recipe, tiny_base, "data-hash", folder) == read_manifest(folder)
    assert weights.stat().st_mtime_ns == stamp
    weights.write_bytes(b"corrupted")
    rebuilt = build_variant("bf16", recipe, tiny_base, "data-hash", folder)
    assert folder_sha256(folder, exclude=("manifest.json",)) == rebuilt.content_hash
    assert load_runtime(folder, TargetConfig(threads=1)).score([[1, 2, 3]])[0][1] == 2


def test_a_variant_damaged_after_its_build_is_refused_naming_the_file_and_both_hashes(tiny_base, tmp_path):
    import re

    from tasks.errors import ArtifactError

    folder = tmp_path / "bf16"
    build_variant("bf16", VariantConfig.model_validate(CLAIMS["bf16"].recipe), tiny_base, "data-hash", folder)
    load_runtime(folder, TargetConfig(threads=1))
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)  # same size: only the content hash can tell
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as refused:
        load_runtime(folder, TargetConfig(threads=1))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{folder}: model.safetensors hashes to ")
    assert re.search(
        r"hashes to [0-9a-f]{12}, the manifest recorded [0-9a-f]{12}; refusing to use it$", message
    )


def test_uniform_model_has_perplexity_equal_to_vocabulary_size(variants, tmp_path):
    """With zero logits every next token has probability 1/V, so perplexity must be exactly V."""
    runtime = load_runtime(variants["baseline"], TargetConfig(threads=1))
    with torch.no_grad():
        runtime.model.lm_head.weight.zero_()  # tied: the embeddings become zero too, logits are all zero
    vocab = runtime.model.config.vocab_size
    result = evaluate_perplexity(runtime, [PROMPT] * 5, EvaluateConfig(window=16, max_tokens=64))
    assert result.perplexity == pytest.approx(vocab, rel=1e-4)
    assert math.isclose(sum(result.window_nll) / sum(result.window_tokens), math.log(vocab), rel_tol=1e-5)

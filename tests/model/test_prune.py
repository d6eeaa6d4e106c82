"""Pruning on a tiny random Llama: sparsity reached, structure shrinks consistently, results reload and heal."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tasks.techniques.prune import (
    count_parameters,
    decoder_linears,
    heal,
    magnitude_importance,
    prune_structured,
    prune_unstructured,
)
from tests.factories import synthetic_sentences

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def original(tiny_model_dir: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def calibration(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tokenizer(text)["input_ids"] for text in synthetic_sentences(8, seed=5)]


@pytest.fixture
def model(original: LlamaForCausalLM) -> LlamaForCausalLM:
    return copy.deepcopy(original)


def zero_fraction(tensor: torch.Tensor) -> float:
    return float((tensor == 0).float().mean())


def mean_loss(model: LlamaForCausalLM, sequences: list[list[int]]) -> float:
    with torch.no_grad():
        return sum(
            model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss.item() for s in sequences
        ) / len(sequences)


@pytest.mark.parametrize("scope", ["global", "layer"])
@pytest.mark.parametrize("sparsity", [0.3, 0.7])
def test_unstructured_pruning_reaches_sparsity_and_zeros_survive_reload(
    model, original, tmp_path, scope, sparsity
):
    report = prune_unstructured(model, sparsity, scope)
    weights = [linear.weight for linear in decoder_linears(model)]
    zeros = sum(int((w == 0).sum()) for w in weights)
    assert abs(zeros / sum(w.numel() for w in weights) - sparsity) <= 0.01
    assert report.sparsity == pytest.approx(zeros / sum(w.numel() for w in weights))
    assert report.model_sparsity == pytest.approx(zeros / count_parameters(model))
    if scope == "layer":
        assert all(abs(zero_fraction(w) - sparsity) <= 0.01 for w in weights)
    assert torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert report.parameters_before == report.parameters_after == count_parameters(original)
    model.save_pretrained(tmp_path / "pruned")
    original.save_pretrained(tmp_path / "dense")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    for pruned_weight, reloaded_linear in zip(weights, decoder_linears(reloaded), strict=True):
        assert torch.equal(pruned_weight, reloaded_linear.weight)
    # The honest note: dense safetensors store the zeros, so the file does not shrink.
    sizes = [(tmp_path / d / "model.safetensors").stat().st_size for d in ("pruned", "dense")]
    assert sizes[0] == sizes[1]
    assert "sparse kernels" in report.note


def expected_parameters(config: LlamaConfig) -> int:
    """Llama parameter count from its config: tied embedding, per layer attention + MLP + 2 norms, final norm."""
    attention = (
        config.hidden_size * config.head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    )
    mlp = 3 * config.hidden_size * config.intermediate_size
    layer = attention + mlp + 2 * config.hidden_size
    return config.vocab_size * config.hidden_size + config.num_hidden_layers * layer + config.hidden_size


def test_structured_pruning_removes_whole_kv_groups_and_reloads(model, original, calibration, tmp_path):
    ratio = original.config.num_attention_heads // original.config.num_key_value_heads
    report = prune_structured(
        model, mlp_fraction=0.25, head_groups=1, importance="magnitude", calibration=None
    )
    config = model.config
    assert (config.intermediate_size, config.num_key_value_heads, config.num_attention_heads) == (
        96,
        1,
        ratio,
    )
    assert config.head_dim == original.config.head_dim == 16
    assert report.parameters_before == expected_parameters(original.config) == count_parameters(original)
    assert report.parameters_after == expected_parameters(config) == count_parameters(model)
    assert report.parameters_before - report.parameters_after == 2 * (3 * 64 * 32 + 64 * 16 * 2 * (ratio + 1))
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.q_proj.weight.shape == (config.num_attention_heads * 16, 64)
        assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (config.num_key_value_heads * 16, 64)
        assert attn.o_proj.weight.shape == (64, config.num_attention_heads * 16)
        assert attn.num_key_value_groups == ratio
        assert layer.mlp.down_proj.weight.shape == (64, 96)
    model.save_pretrained(tmp_path / "pruned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    ids = torch.tensor([calibration[0]])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    cached = reloaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = reloaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape == (1, ids.shape[1] + 6)
    assert torch.equal(cached, uncached)


def test_structured_pruning_equals_zeroing_the_removed_neurons_and_heads(model, original, calibration):
    """Slicing must keep each query head with its own KV head: the small model computes what the masked one does."""
    masked = copy.deepcopy(original)
    neuron_scores, group_scores = magnitude_importance(original)
    with torch.no_grad():
        for layer, neurons, groups in zip(masked.model.layers, neuron_scores, group_scores, strict=True):
            layer.mlp.up_proj.weight[neurons.argsort()[:32]] = 0
            removed_group = int(groups.argmin())
            layer.self_attn.o_proj.weight[:, removed_group * 32 : (removed_group + 1) * 32] = 0
    prune_structured(model, mlp_fraction=0.25, head_groups=1, importance="magnitude", calibration=None)
    ids = torch.tensor([calibration[1]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, masked(input_ids=ids).logits)
        assert not torch.allclose(original(input_ids=ids).logits, masked(input_ids=ids).logits)


def plant_dead_but_heavy_units(model: LlamaForCausalLM) -> None:
    """Neuron 5 and KV group 0 get large weights but output exactly zero: magnitude keeps them, activation not."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight[5] = 0
            layer.mlp.down_proj.weight[:, 5] *= 50
            layer.self_attn.v_proj.weight[:16] = 0
            layer.self_attn.q_proj.weight[:32] *= 50


def test_activation_importance_removes_the_silent_units_that_magnitude_keeps(original, calibration):
    planted = copy.deepcopy(original)
    plant_dead_but_heavy_units(planted)
    by_activation, by_magnitude = copy.deepcopy(planted), copy.deepcopy(planted)
    prune_structured(by_activation, 1 / 128, 1, "activation", calibration)
    prune_structured(by_magnitude, 1 / 128, 1, "magnitude", None)
    for before, active, magnitude in zip(
        planted.model.layers, by_activation.model.layers, by_magnitude.model.layers, strict=True
    ):
        without_neuron_5 = torch.cat([before.mlp.up_proj.weight[:5], before.mlp.up_proj.weight[6:]])
        assert torch.equal(active.mlp.up_proj.weight, without_neuron_5)
        assert torch.equal(active.self_attn.k_proj.weight, before.self_attn.k_proj.weight[16:])
        assert torch.equal(active.self_attn.q_proj.weight, before.self_attn.q_proj.weight[32:])
        assert (magnitude.mlp.gate_proj.weight.abs().sum(1) == 0).any()
        assert torch.equal(magnitude.self_attn.k_proj.weight, before.self_attn.k_proj.weight[:16])


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"mlp_fraction": 1.0}, "mlp_fraction"),
        ({"mlp_fraction": -0.1}, "mlp_fraction"),
        ({"mlp_fraction": 0.999}, "mlp_fraction"),
        ({"head_groups": 2}, "head_groups"),
        ({"head_groups": -1}, "head_groups"),
        ({"importance": "random"}, "importance"),
        ({"importance": "activation", "calibration": None}, "calibration"),
    ],
)
def test_structured_pruning_rejects_invalid_arguments_by_name(model, arguments, named):
    valid = {"mlp_fraction": 0.25, "head_groups": 1, "importance": "magnitude", "calibration": None}
    before = count_parameters(model)
    with pytest.raises(ValueError, match=named):
        prune_structured(model, **{**valid, **arguments})
    assert count_parameters(model) == before


@pytest.mark.parametrize(("sparsity", "scope", "named"), [(1.0, "global", "sparsity"), (0.5, "row", "scope")])
def test_unstructured_pruning_rejects_invalid_arguments_by_name(model, sparsity, scope, named):
    with pytest.raises(ValueError, match=named):
        prune_unstructured(model, sparsity, scope)


def test_structured_pruning_refuses_head_counts_that_transformers_cannot_reload():
    """LlamaConfig validates hidden_size % num_attention_heads on load, even with an explicit head_dim."""
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with pytest.raises(ValueError, match="head_groups: 1 leaves 3 attention heads"):
        prune_structured(LlamaForCausalLM(config), 0.0, 1, "magnitude", None)


def test_healing_lowers_the_loss_of_a_pruned_model_on_its_calibration_batches(model, calibration):
    prune_structured(model, mlp_fraction=0.5, head_groups=1, importance="magnitude", calibration=None)
    before = mean_loss(model, calibration)
    seen = []
    losses = heal(model, calibration, steps=16, lr=3e-3, on_step=lambda step, loss: seen.append((step, loss)))
    assert len(losses) == 16
    assert seen == list(enumerate(losses, start=1))
    assert mean_loss(model, calibration) < before - 0.3
    assert not model.training

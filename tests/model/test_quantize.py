"""Each quantization backend: apply in memory → save with its own serialization → reload the same model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.config import RuntimeSettings, TargetConfig
from tasks.errors import TargetError
from tasks.measure.benchmark import decode_read_bytes, weight_bytes
from tasks.params import Config
from tasks.targets import target_problems
from tasks.techniques.quantize.methods import METHODS as QUANTIZE_METHODS
from tasks.techniques.quantize.methods import Quantized
from tasks.techniques.quantize.step import QuantizeStep, quantize_model
from tasks.techniques.tinygemm_rounding import (
    gptq_onto_tinygemm,
    tinygemm_dequantized,
    tinygemm_levels,
    tinygemm_qparams,
)
from tasks.weights.catalog import weights_format
from tasks.weights.on_load import ON_LOAD

# torch kernels sum in other orders per instruction set: `make test` runs these again on a second one
pytestmark = pytest.mark.numerics

# Reloaded logits equal the in-memory quantized model's; quanto W8A8 re-derives its activation quantizers on
# reload and lands within its own quantization noise (measured 0.009 on the tiny model).
ROUND_TRIP_ATOL = {"quanto_w8a8": 0.05}
# Quantized in memory and saved: every method that runs on a CPU, except those torchao quantizes when loaded
METHODS = [m for m, method in QUANTIZE_METHODS.items() if "cpu" in method.devices and not method.on_load]
IDS = torch.tensor([[5, 17, 33, 40, 77, 100, 120, 7, 9, 11, 60, 61]])


def save_quantized(done: Quantized, dest) -> None:
    """Write a quantized model with its weights format, as the build does."""
    weights_format(done.weights_format, dest).save(done.model, dest, "float32", done.record)


def load_quantized(folder, name: str, device: str = "cpu"):
    """Load it back with the format's own loader, as the torch engine does."""
    return weights_format(name, folder).load(
        folder, "float32", RuntimeSettings(), TargetConfig(device=device)
    )


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_round_trips_through_its_own_serialization(tiny_model_dir, tmp_path, method):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    done = quantize_model(model, QuantizeStep(method=method), [IDS[0].tolist()] * 2)
    save_quantized(done, tmp_path)
    quantized, reloaded = done.model, load_quantized(tmp_path, done.weights_format)
    with torch.no_grad():
        before, after = quantized(IDS).logits, reloaded(IDS).logits
        continuation = reloaded.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.allclose(before, after, atol=ROUND_TRIP_ATOL.get(method, 1e-5))
    assert continuation.shape == (1, IDS.shape[1] + 4)


def test_quanto_w8a8_without_calibration_text_is_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="calibrates on the calibration split"):
        quantize_model(model, QuantizeStep(method="quanto_w8a8"), [])


def _anisotropic_inputs(columns: int, tokens: int = 512) -> torch.Tensor:
    """Calibration inputs whose features differ in scale (as a real layer's do), so GPTQ has something to use."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(tokens, columns, generator=generator) * torch.linspace(0.1, 3.0, columns)


def test_gptq_onto_torchaos_grid_keeps_its_integers_through_torchaos_own_rounding_and_beats_it():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=generator)
    weight[3, :64] = 0.25  # a constant group
    inputs = _anisotropic_inputs(256)
    rounded = gptq_onto_tinygemm(weight, inputs.T @ inputs / len(inputs), 64)
    assert torch.equal(tinygemm_levels(rounded.weight, 64), rounded.levels)  # what torchao stores at load
    scale, zero = tinygemm_qparams(weight.to(torch.bfloat16), 64)
    derived = tinygemm_qparams(rounded.weight, 64)[0]
    assert torch.allclose(derived.float(), scale.float(), rtol=2**-6)  # the same grid, to a bfloat16 unit
    assert torch.equal(tinygemm_dequantized(rounded.levels, rounded.weight, 64), rounded.weight)  # as it runs
    assert rounded.levels.min() == 0 and rounded.levels.max() == 15

    def output_error(candidate: torch.Tensor) -> float:
        return float(((inputs @ (candidate.float() - weight).T) ** 2).mean())

    rtn_levels = tinygemm_levels(weight.to(torch.bfloat16), 64)
    rtn = (rtn_levels.float() - 8) * scale.float().repeat_interleave(64, 1) + zero.float().repeat_interleave(
        64, 1
    )
    assert output_error(rounded.weight) < 0.9 * output_error(rtn)
    assert not torch.equal(rounded.levels, rtn_levels)


@pytest.mark.parametrize("method", ["torchao_int4_tinygemm", "torchao_int4_gptq"])
def test_torchao_int4_is_packed_when_loaded_and_runs_exactly_the_stored_grid(
    tiny_model_dir, tmp_path, method
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():  # a group far narrower than the CPU kernel's smallest step (1e-6 × 15)
        model.model.layers[0].mlp.up_proj.weight[:4].mul_(1e-5)
    step = QuantizeStep(method=method)
    windows = [[(i * 7 + j) % 300 for j in range(48)] for i in range(4)]
    done = quantize_model(model, step, windows)
    assert done.weights_format == ON_LOAD
    save_quantized(done, tmp_path)
    stored = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    loaded = load_quantized(tmp_path, ON_LOAD, "cpu")
    packed = [
        name
        for name, module in loaded.named_modules()
        if type(getattr(module, "weight", None)).__name__ == "Int4OpaqueTensor"
    ]
    assert len(packed) == 7 * loaded.config.num_hidden_layers  # every decoder matrix; the tied lm_head stays
    with torch.no_grad():
        run, plain = loaded(IDS).logits.float(), stored(IDS).logits.float()
    assert torch.allclose(run, plain, atol=0.05 * plain.abs().max())  # the kernel multiplies the stored grid
    for (
        name
    ) in packed:  # what the packed kernel multiplies by (identity in) is the stored weight, to rounding
        weight = stored.get_submodule(name).weight.float()
        columns = weight.shape[1]
        with torch.no_grad():
            effective = loaded.get_submodule(name)(torch.eye(columns, dtype=torch.bfloat16)).float().T
        step_size = (
            weight.reshape(weight.shape[0], -1, 64).amax(2) - weight.reshape(weight.shape[0], -1, 64).amin(2)
        ) / 15
        # a quarter step, the bfloat16 output's rounding, and the CPU kernel's own rounding of a flat group's zero
        # point (its smallest scale, 1e-6, times 8, held in bfloat16)
        allowed = 0.25 * step_size.repeat_interleave(64, 1) + 2**-8 * weight.abs() + 8e-6 * 2**-7
        assert ((effective - weight).abs() <= allowed).all(), name
    cpu, cuda = decode_read_bytes(tmp_path, "cpu"), decode_read_bytes(tmp_path, "cuda")
    assert cpu < 0.75 * weight_bytes(tmp_path)  # counted packed, not as stored
    assert (
        cuda > cpu
    )  # CUDA's tile packing pads the inputs to 1024 (64 here): the roofline counts the padding


def test_a_group_size_that_leaves_decoder_matrices_unquantized_is_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir
    )  # hidden size 64: a group of 128 does not fit
    with pytest.raises(
        ValueError, match=r"group_size: 128 leaves 12 decoder matrices unquantized \(e.g. model"
    ):
        quantize_model(model, QuantizeStep(method="torchao_int4_tinygemm", group_size=128), [])


def _quantize_on(device: str, method: str, capability: tuple[int, int] | None, monkeypatch) -> list[str]:
    import tasks.measure.fingerprint

    monkeypatch.setattr(tasks.measure.fingerprint, "cuda_capability", lambda _device: capability)
    config = Config.model_validate(
        {
            "target": {"device": device},
            "variants": {"baseline": {}, "q": {"steps": [{"quantize": {"method": method}}]}},
        }
    )
    return target_problems(config, cuda_available=device != "cpu", cuda_devices=1)


@pytest.mark.parametrize(
    ("device", "method", "capability", "refusal"),
    [
        (
            "cpu",
            "torchao_fp8_per_row",
            None,
            "does not run on cpu: FP8 matmuls need a GPU of compute capability 8.9",
        ),
        (
            "cuda",
            "torchao_fp8_per_row",
            (8, 6),
            "needs a GPU of compute capability 8.9 or more, cuda has 8.6",
        ),
        ("cuda", "torchao_int4_tinygemm", (7, 5), "needs a GPU of compute capability 8.0 or more"),
        (
            "cuda",
            "torch_dynamic_int8",
            (9, 0),
            "does not run on cuda: torch's dynamic int8 kernels are CPU-only",
        ),
        ("cuda", "gptqmodel", (9, 0), "gptqmodel is not driven by llmopt"),
        ("cuda", "torchao_fp8_per_row", (9, 0), None),
        ("cuda", "torchao_int4_gptq", (9, 0), None),
        ("cuda", "bnb_nf4", (9, 0), None),
        ("cpu", "torchao_int4_gptq", None, None),
    ],
)
def test_each_method_runs_on_the_devices_it_declares_and_is_refused_elsewhere_in_one_line(
    device, method, capability, refusal, monkeypatch
):
    problems = _quantize_on(device, method, capability, monkeypatch)
    if refusal is None:
        assert problems == []
    else:
        (problem,) = problems
        assert problem.startswith("variants.q.steps[0].quantize.method: ") and refusal in problem
        assert "use " in problem


def test_an_fp8_variant_loaded_on_a_cpu_says_it_needs_cuda(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    step = QuantizeStep(method="torchao_fp8_per_row")
    save_quantized(quantize_model(model, step, []), tmp_path)
    with pytest.raises(TargetError, match="fp8_per_row runs on cuda, not cpu"):
        load_quantized(tmp_path, ON_LOAD, "cpu")

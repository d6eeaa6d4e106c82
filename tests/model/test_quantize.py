"""Each quantization backend: apply in memory → save with its own serialization → reload the same model."""

from __future__ import annotations

import typing

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.engines.torch_weights import load_quantized
from tasks.techniques.quantize import QuantizeMethod, QuantizeStep, quantize_model, save_quantized

# Reloaded logits equal the in-memory quantized model's; quanto W8A8 re-derives its activation quantizers on
# reload and lands within its own quantization noise (measured 0.009 on the tiny model).
ROUND_TRIP_ATOL = {"quanto_w8a8": 0.05}
METHODS = [m for m in typing.get_args(QuantizeMethod) if m != "gptqmodel"]  # gptqmodel: GPU targets only
IDS = torch.tensor([[5, 17, 33, 40, 77, 100, 120, 7, 9, 11, 60, 61]])


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_round_trips_through_its_own_serialization(tiny_model_dir, tmp_path, method):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    quantized, weights_format = quantize_model(model, QuantizeStep(method=method), [IDS[0].tolist()] * 2)
    save_quantized(quantized, weights_format, tmp_path)
    reloaded = load_quantized(tmp_path, weights_format)
    with torch.no_grad():
        before, after = quantized(IDS).logits, reloaded(IDS).logits
        continuation = reloaded.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.allclose(before, after, atol=ROUND_TRIP_ATOL.get(method, 1e-5))
    assert continuation.shape == (1, IDS.shape[1] + 4)


def test_quanto_w8a8_without_calibration_text_is_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="calibrates on the calibration split"):
        quantize_model(model, QuantizeStep(method="quanto_w8a8"), [])

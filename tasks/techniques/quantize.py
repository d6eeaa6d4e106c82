"""quantize: weight quantization backends behind one step (torch, torchao, optimum-quanto, bitsandbytes).

Each backend is imported only inside the function that needs it (their imports take 3–6 s). Artifacts use the
library's own serialization (loaded back by `tasks.engines.torch_weights`): torchao and bitsandbytes through transformers (`quantization_config` in config.json,
reloaded by `from_pretrained`), quanto as its state dict plus `quantization_map.json` (reloaded by `requantize`).
GPTQ needs gptqmodel's CUDA kernels; on a cpu target the target check refuses it before any work starts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tasks.config import QuantizeStep
from tasks.engines.torch_weights import (
    QUANTO,
    QUANTO_MAP_FILE,
    TORCH_DYNAMIC,
    TORCH_DYNAMIC_FILE,
    TRANSFORMERS_QUANTIZED,
    quantize_dynamic_int8,
)

NOTES = {
    "torch_dynamic_int8": "int8 per-channel weights, int8 activations quantized per batch (W8A8 dynamic)",
    "torchao_int8_weight_only": "torchao int8 per-channel weights, float activations (W8A16)",
    "torchao_int8_dynamic": "torchao int8 weights + int8 activations quantized per token at run time (W8A8)",
    "torchao_int4_weight_only": "torchao int4 weights in groups (IntxWeightOnly; stored one int4 per int8 byte)",
    "quanto_w8a16": "optimum-quanto int8 weights, float activations",
    "quanto_w4a16": "optimum-quanto int4 weights (groups of 64), float activations",
    "quanto_w8a8": "optimum-quanto int8 weights + int8 activations with scales calibrated on the calibration split "
    "(lm_head kept float: its activations do not survive int8)",
    "bnb_nf4": "bitsandbytes 4-bit NormalFloat weights",
    "bnb_fp4": "bitsandbytes 4-bit float weights",
    "bnb_int8": "bitsandbytes LLM.int8() (int8 weights, outlier features in 16-bit)",
}


def quantize_model(model: Any, step: QuantizeStep, calibration: list[list[int]]) -> tuple[Any, str]:
    """Quantize a float model in memory; returns (model, weights format)."""
    if step.method == "torch_dynamic_int8":
        return quantize_dynamic_int8(model), TORCH_DYNAMIC
    if step.method.startswith("quanto_"):
        return quantize_quanto(model, step, calibration), QUANTO
    if step.method.startswith(("torchao_", "bnb_")):
        return quantize_at_load(model, transformers_quantization_config(step)), TRANSFORMERS_QUANTIZED
    raise ValueError(f"method: {step.method} cannot run on this target")  # gptq: refused by the target check


def transformers_quantization_config(step: QuantizeStep) -> Any:
    """The transformers `quantization_config` of a torchao or bitsandbytes method."""
    import torch

    if step.method.startswith("bnb_"):
        from transformers import BitsAndBytesConfig

        if step.method == "bnb_int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=step.method.removeprefix("bnb_"),
            bnb_4bit_use_double_quant=step.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, step.compute_dtype),
        )
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    configs = {
        "torchao_int8_weight_only": Int8WeightOnlyConfig,
        "torchao_int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "torchao_int4_weight_only": lambda: IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(step.group_size)
        ),
    }
    return TorchAoConfig(configs[step.method]())


def quantize_at_load(model: Any, quantization_config: Any) -> Any:
    """Save the float model and reload it with `quantization_config`: how transformers applies these backends."""
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="llmopt-quantize-") as scratch:
        model.save_pretrained(scratch)
        return AutoModelForCausalLM.from_pretrained(
            scratch, quantization_config=quantization_config, dtype=torch.float32
        )


def quantize_quanto(model: Any, step: QuantizeStep, calibration: list[list[int]]) -> Any:
    """optimum-quanto weights (and, for w8a8, activations calibrated on `calibration`), frozen to packed tensors."""
    import torch
    from optimum.quanto import Calibration, freeze, qint4, qint8, quantize

    weights = qint4 if step.method == "quanto_w4a16" else qint8
    if step.method != "quanto_w8a8":
        quantize(model, weights=weights)
    else:
        quantize(model, weights=weights, activations=qint8, exclude="lm_head")
        if not calibration:
            raise ValueError("method: quanto_w8a8 calibrates on the calibration split, which is empty")
        with torch.no_grad(), Calibration():
            for ids in calibration:
                model(input_ids=torch.tensor([ids]))
    freeze(model)
    return model


def save_quantized(model: Any, weights_format: str, dest: Path) -> None:
    """Write the quantized model with its backend's serialization (config and generation config included)."""
    import torch

    if weights_format == TRANSFORMERS_QUANTIZED:
        model.save_pretrained(dest)
        return
    model.config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    if weights_format == TORCH_DYNAMIC:
        torch.save(model.state_dict(), dest / TORCH_DYNAMIC_FILE)
        return
    from optimum.quanto import quantization_map
    from safetensors.torch import save_file

    state = model.state_dict()
    head, embeddings = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and embeddings is not None and head.data_ptr() == embeddings.data_ptr():
        del state[
            "lm_head.weight"
        ]  # tied (left float): safetensors refuses shared tensors; re-tied when loaded
    save_file(state, dest / "model.safetensors")
    (dest / QUANTO_MAP_FILE).write_text(json.dumps(quantization_map(model), indent=1, sort_keys=True))

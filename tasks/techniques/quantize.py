"""quantize: weight quantization backends behind one step (torch, torchao, optimum-quanto, bitsandbytes).

Each backend is imported only inside the function that needs it (their imports take 3–6 s). Artifacts use the
library's own serialization (loaded back by `tasks.engines.torch_weights`): torchao and bitsandbytes through transformers (`quantization_config` in config.json,
reloaded by `from_pretrained`), quanto as its state dict plus `quantization_map.json` (reloaded by `requantize`).
GPTQ needs gptqmodel's CUDA kernels; on a cpu target the target check refuses it before any work starts.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.schema import Former, Strict
from tasks.techniques.calibration import WINDOW_TOKENS
from tasks.techniques.registry import Applied, Row, Technique, register, step_arguments

if TYPE_CHECKING:
    from tasks.config import Config
    from tasks.engines.manifest import VariantManifest


@dataclass(frozen=True)
class Method:
    note: str  # what it stores and runs, for the manifest and the technique table
    bits: int | None  # bits per weight (None: the `bits` setting says)
    packages: tuple[str, ...] = ()  # what a registered variant needs to load it (beyond the serving set)


METHODS = {
    "torch_dynamic_int8": Method(
        "int8 per-channel weights, int8 activations quantized per batch (W8A8 dynamic)", 8
    ),
    "torchao_int8_weight_only": Method(
        "torchao int8 per-channel weights, float activations (W8A16)", 8, ("accelerate", "torchao")
    ),
    "torchao_int8_dynamic": Method(
        "torchao int8 weights + int8 activations quantized per token at run time (W8A8)",
        8,
        ("accelerate", "torchao"),
    ),
    "torchao_int4_weight_only": Method(
        "torchao int4 weights in groups (IntxWeightOnly; stored one int4 per int8 byte)",
        4,
        ("accelerate", "torchao"),
    ),
    "quanto_w8a16": Method("optimum-quanto int8 weights, float activations", 8, ("optimum-quanto",)),
    "quanto_w4a16": Method(
        "optimum-quanto int4 weights (groups of 64), float activations", 4, ("optimum-quanto",)
    ),
    "quanto_w8a8": Method(
        "optimum-quanto int8 weights + int8 activations with scales calibrated on the calibration split "
        "(lm_head kept float: its activations do not survive int8)",
        8,
        ("optimum-quanto",),
    ),
    "bnb_nf4": Method("bitsandbytes 4-bit NormalFloat weights", 4, ("accelerate", "bitsandbytes")),
    "bnb_fp4": Method("bitsandbytes 4-bit float weights", 4, ("accelerate", "bitsandbytes")),
    "bnb_int8": Method(
        "bitsandbytes LLM.int8() (int8 weights, outlier features in 16-bit)",
        8,
        ("accelerate", "bitsandbytes"),
    ),
    "gptqmodel": Method("gptqmodel's GPTQ (CUDA only)", None, ("gptqmodel",)),
}
NOTES = {name: method.note for name, method in METHODS.items()}

QuantizeMethod = Literal[tuple(METHODS)]  # type: ignore[valid-type]


class QuantizeStep(Strict):
    """Weight quantization; see tasks/techniques/quantize.py for what each method stores and runs."""

    # gptqmodel was `gptq`, which read as llmopt's own GPTQ rounding (onnx_genai rounding: gptq)
    FORMER: ClassVar[dict[str, Former]] = {"method": Former("method", {"gptq": "gptqmodel"})}
    method: QuantizeMethod
    # Method-specific settings; setting one that another method owns is refused.
    group_size: Literal[32, 64, 128, 192] = 64  # torchao_int4_weight_only, gptqmodel (SmolLM2's 576 = 9 × 64)
    double_quant: bool = True  # bnb_nf4 / bnb_fp4: also quantize the scales
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bnb_nf4 / bnb_fp4 matmuls
    bits: Literal[2, 3, 4, 8] = 4  # gptqmodel
    desc_act: bool = False  # gptqmodel: quantize columns by decreasing activation order
    # quanto_w8a8: calibration windows (of 256 tokens) its activation scales are set on
    calibration_windows: Annotated[int, Field(ge=1, le=4096)] = 16

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> QuantizeStep:
        owners = {
            "group_size": ("torchao_int4_weight_only", "gptqmodel"),
            "double_quant": ("bnb_nf4", "bnb_fp4"),
            "compute_dtype": ("bnb_nf4", "bnb_fp4"),
            "bits": ("gptqmodel",),
            "desc_act": ("gptqmodel",),
            "calibration_windows": ("quanto_w8a8",),
        }
        for name in sorted(name for name in owners if name in self.model_fields_set):
            if self.method not in owners[name]:
                raise ValueError(f"{name} applies to {' / '.join(owners[name])}, not {self.method}")
        return self


@register
class Quantize(Technique):
    name = "quantize"
    settings = QuantizeStep
    role = "quantize"

    def apply(self, model: Any, settings: QuantizeStep, context: Any) -> Applied:

        calibration = (
            context.sequences(context.tokenizer, WINDOW_TOKENS, limit=settings.calibration_windows)
            if settings.method == "quanto_w8a8"
            else []
        )
        with step_arguments(self.name):
            model, weights_format = quantize_model(model, settings, calibration)
        return Applied(model, weights_format, NOTES[settings.method])

    def weight_bits(self, settings: QuantizeStep, manifest: VariantManifest) -> int | None:
        return METHODS[settings.method].bits or settings.bits

    def packages(self, settings: QuantizeStep) -> list[str]:
        return list(METHODS[settings.method].packages)

    def problems(self, where: str, settings: QuantizeStep, config: Config, cuda_available: bool) -> list[str]:
        if config.target.is_cuda:
            return [
                f"{where}.method: {settings.method} has not been run on a GPU by llmopt yet (its cuda path comes "
                "with the GPU techniques); on cuda use runtime.dtype bfloat16 or float16"
            ]
        if settings.method == "gptqmodel" and not config.target.is_cuda:
            return [
                f"{where}.method: gptqmodel needs a cuda target (gptqmodel's kernels and calibration are CUDA-only; "
                "its sdist does not build here); use onnx_genai int4 or quanto_w4a16 on cpu"
            ]
        return []

    def rows(self) -> list[Row]:
        return [
            Row(
                "`quantize: {method: torch_dynamic_int8}`",
                (),
                "per-channel int8 weights, int8 activations per batch, every `nn.Linear` (PyTorch dynamic "
                "quantization)",
            ),
            Row(
                "`quantize: {method: torchao_int8_weight_only \\| torchao_int8_dynamic}`",
                (),
                "torchao W8A16 / W8A8 (per-token dynamic activations), saved and reloaded through transformers' "
                "`TorchAoConfig`",
            ),
            Row(
                "`quantize: {method: torchao_int4_weight_only}`",
                ("group_size",),
                "torchao int4 in groups (`IntxWeightOnlyConfig`); stored one int4 per byte, so **no smaller on "
                "disk**",
            ),
            Row(
                "`quantize: {method: quanto_w8a16 \\| quanto_w4a16 \\| quanto_w8a8}`",
                ("calibration_windows",),
                "optimum-quanto; W8A8 calibrates activation scales on `calibration_windows` windows of the "
                "calibration split, `lm_head` kept "
                "float; saved as quanto's state dict + `quantization_map.json`",
            ),
            Row(
                "`quantize: {method: bnb_nf4 \\| bnb_fp4}`",
                ("double_quant", "compute_dtype"),
                "bitsandbytes 4-bit (CPU backend), saved through transformers",
            ),
            Row("`quantize: {method: bnb_int8}`", (), "bitsandbytes LLM.int8()"),
            Row(
                "`quantize: {method: gptqmodel}`",
                ("bits", "group_size", "desc_act"),
                "**GPU targets only**: gptqmodel's kernels and calibration need CUDA (its sdist does not build "
                "here); refused on `target.device: cpu` before any work",
            ),
        ]


def quantize_model(model: Any, step: QuantizeStep, calibration: list[list[int]]) -> tuple[Any, str]:
    """Quantize a float model in memory; returns (model, weights format)."""
    from tasks.engines.torch_weights import (
        QUANTO,
        TORCH_DYNAMIC,
        TRANSFORMERS_QUANTIZED,
        quantize_dynamic_int8,
    )

    if step.method == "torch_dynamic_int8":
        return quantize_dynamic_int8(model), TORCH_DYNAMIC
    if step.method.startswith("quanto_"):
        return quantize_quanto(model, step, calibration), QUANTO
    if step.method.startswith(("torchao_", "bnb_")):
        return quantize_at_load(model, transformers_quantization_config(step)), TRANSFORMERS_QUANTIZED
    raise ValueError(
        f"method: {step.method} cannot run on this target"
    )  # gptqmodel: refused by the target check


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

    from tasks.engines.torch_weights import (
        QUANTO_MAP_FILE,
        TORCH_DYNAMIC,
        TORCH_DYNAMIC_FILE,
        TRANSFORMERS_QUANTIZED,
    )

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

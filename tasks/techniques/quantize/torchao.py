"""torchao's methods. int8 (weight-only and dynamic) and IntxWeightOnly int4 are saved and reloaded through
transformers' `TorchAoConfig`; tinygemm int4 and FP8 pack weights for the device they run on, so those store
bfloat16 weights on their grid and are quantized when loaded there (tasks/weights/on_load.py)."""

from __future__ import annotations

from typing import Any

from tasks.techniques.quantize.methods import Quantized, QuantizeSettings, QuantMethod, register_method
from tasks.techniques.quantize.transformers_load import quantize_at_load
from tasks.techniques.registry import Row
from tasks.weights.on_load import FP8_PER_ROW, ON_LOAD, TINYGEMM_INT4, on_load_modules
from tasks.weights.transformers_quantized import TRANSFORMERS_QUANTIZED

TORCHAO = ("accelerate", "torchao")


def _transformers_config(settings: QuantizeSettings) -> Any:
    """The transformers `quantization_config` of a torchao method quantized at build."""
    import torch
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
            weight_dtype=torch.int4, granularity=PerGroup(settings.group_size)
        ),
    }
    return TorchAoConfig(configs[settings.method]())


def _quantize_at_build(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    return Quantized(quantize_at_load(model, _transformers_config(settings)), TRANSFORMERS_QUANTIZED)


def on_load_record(settings: QuantizeSettings, kernel: str) -> dict[str, Any]:
    """What `quantize-on-load.json` says: the torchao kernel, its group size, the method that wrote it."""
    group = {"group_size": settings.group_size} if kernel == TINYGEMM_INT4 else {}
    return {"kernel": kernel, "method": settings.method, **group}


def round_onto_torchao_grid(
    model: Any, settings: QuantizeSettings, calibration: list[list[int]] | None, progress: Any = None
) -> Quantized:
    """Put the weights torchao quantizes at load on its tinygemm grid, in place: GPTQ's levels (with
    `calibration`) or round-to-nearest's (None), so the stored bfloat16 weights are exactly what the kernel runs."""
    import torch

    from tasks.techniques.tinygemm_rounding import round_onto_tinygemm

    record = on_load_record(settings, TINYGEMM_INT4)
    modules = on_load_modules(model, record)
    refuse_unquantized_decoder_matrices(model, modules, settings, record["kernel"])
    rounded = round_onto_tinygemm(model, modules, settings.group_size, calibration, progress)
    with torch.no_grad():
        for name, result in rounded.items():
            modules[name].weight.copy_(result.weight.float())
    return Quantized(model, ON_LOAD, record)


def _tinygemm(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    return round_onto_torchao_grid(model, settings, None, progress)


def _fp8(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    record = on_load_record(settings, FP8_PER_ROW)
    refuse_unquantized_decoder_matrices(model, on_load_modules(model, record), settings, record["kernel"])
    return Quantized(model, ON_LOAD, record)


def refuse_unquantized_decoder_matrices(
    model: Any, chosen: dict[str, Any], settings: QuantizeSettings, kernel: str
) -> None:
    """A decoder matrix torchao would leave in bfloat16 (its inputs do not split into whole groups, or its outputs
    are not a multiple of 16) is refused, naming it: the variant would be reported as 4-bit and not be."""
    import torch

    left = [
        f"{name} ({module.out_features}×{module.in_features})"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and name not in chosen
    ]
    if left:
        group = f"group_size: {settings.group_size}" if kernel == TINYGEMM_INT4 else "FP8"
        raise ValueError(
            f"method: {settings.method}: {group} leaves {len(left)} decoder matrices unquantized (e.g. {left[0]}: "
            "inputs must split into whole groups, outputs be a multiple of 16); choose a group that divides them"
        )


def tinygemm_groups(settings: QuantizeSettings) -> str:
    """tinygemm's group sizes (the step allows more for other methods)."""
    if settings.group_size not in (32, 64, 128):
        return f"group_size: torchao's tinygemm int4 takes 32, 64 or 128, not {settings.group_size}"
    return ""


register_method(
    QuantMethod(
        "torchao_int8_weight_only",
        "torchao int8 per-channel weights, float activations (W8A16)",
        8,
        _quantize_at_build,
        TORCHAO,
        rows=(
            Row(
                "`quantize: {method: torchao_int8_weight_only \\| torchao_int8_dynamic}`",
                (),
                "torchao W8A16 / W8A8 (per-token dynamic activations), saved and reloaded through transformers' "
                "`TorchAoConfig`",
            ),
        ),
    )
)
register_method(
    QuantMethod(
        "torchao_int8_dynamic",
        "torchao int8 weights + int8 activations quantized per token at run time (W8A8)",
        8,
        _quantize_at_build,
        TORCHAO,
    )
)
register_method(
    QuantMethod(
        "torchao_int4_weight_only",
        "torchao int4 weights in groups (IntxWeightOnly; stored one int4 per int8 byte)",
        4,
        _quantize_at_build,
        TORCHAO,
        takes=("group_size",),
        rows=(
            Row(
                "`quantize: {method: torchao_int4_weight_only}`",
                ("group_size",),
                "torchao int4 in groups (`IntxWeightOnlyConfig`); stored one int4 per byte, so **no smaller on "
                "disk**",
            ),
        ),
    )
)
register_method(
    QuantMethod(
        "torchao_int4_tinygemm",
        "torchao int4 in groups, asymmetric with a float zero point, rounded to nearest (tinygemm: tile-packed on a "
        "CUDA GPU, the CPU's int4 pack on a CPU), bfloat16 activations; stored as bfloat16 on the grid, packed "
        "when loaded",
        4,
        _tinygemm,
        TORCHAO,
        capability=(8, 0),
        takes=("group_size",),
        on_load=TINYGEMM_INT4,
        check=tinygemm_groups,
        rows=(
            Row(
                "`quantize: {method: torchao_int4_tinygemm}`",
                ("group_size",),
                "torchao's tinygemm int4 (asymmetric groups, float zero point; bfloat16 activations): tile-packed "
                "kernels on a CUDA GPU (compute capability 8.0+), the CPU's int4 kernel on a CPU. Stored as "
                "bfloat16 on the grid and packed when loaded, so **no smaller on disk**",
            ),
        ),
    )
)
register_method(
    QuantMethod(
        "torchao_fp8_per_row",
        "torchao FP8 (e4m3) weights and activations, one scale per row / token (W8A8-FP8), bfloat16 elsewhere; "
        "stored as bfloat16, quantized when loaded",
        8,
        _fp8,
        TORCHAO,
        devices=("cuda",),
        instead="FP8 matmuls need a GPU of compute capability 8.9 or more; on cpu use torchao_int8_dynamic",
        capability=(8, 9),
        on_load=FP8_PER_ROW,
        rows=(
            Row(
                "`quantize: {method: torchao_fp8_per_row}`",
                (),
                "**GPU targets, compute capability 8.9+**: torchao FP8 weights and activations, one scale per "
                "row / token; quantized when loaded",
            ),
        ),
    )
)

"""PyTorch's dynamic int8 quantization: int8 per-channel weights, activations quantized per batch (CPU kernels)."""

from __future__ import annotations

from typing import Any

from tasks.techniques.quantize.methods import Quantized, QuantMethod, register_method
from tasks.techniques.registry import Row
from tasks.weights.torch_dynamic import TORCH_DYNAMIC, quantize_dynamic_int8


def _quantize(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    return Quantized(quantize_dynamic_int8(model), TORCH_DYNAMIC)


register_method(
    QuantMethod(
        "torch_dynamic_int8",
        "int8 per-channel weights, int8 activations quantized per batch (W8A8 dynamic)",
        8,
        _quantize,
        devices=("cpu",),
        instead="torch's dynamic int8 kernels are CPU-only (fbgemm/onednn); on cuda use torchao_int8_dynamic",
        rows=(
            Row(
                "`quantize: {method: torch_dynamic_int8}`",
                (),
                "per-channel int8 weights, int8 activations per batch, every `nn.Linear` (PyTorch dynamic "
                "quantization)",
            ),
        ),
    )
)

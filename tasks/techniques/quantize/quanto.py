"""optimum-quanto: int8 or int4 weights with float activations, or int8 weights and activations whose scales are
calibrated on the calibration split; frozen to packed tensors, saved as quanto's state dict + quantization map."""

from __future__ import annotations

from typing import Any

from tasks.techniques.quantize.methods import Quantized, QuantMethod, register_method
from tasks.techniques.registry import Row
from tasks.weights.quanto import QUANTO

QUANTO_PACKAGES = ("optimum-quanto",)


def _quantize(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    """optimum-quanto weights (and, for w8a8, activations calibrated on `calibration`), frozen to packed tensors."""
    import torch
    from optimum.quanto import Calibration, freeze, qint4, qint8, quantize

    weights = qint4 if settings.method == "quanto_w4a16" else qint8
    if settings.method != "quanto_w8a8":
        quantize(model, weights=weights)
    else:
        quantize(model, weights=weights, activations=qint8, exclude="lm_head")
        if not calibration:
            raise ValueError("method: quanto_w8a8 calibrates on the calibration split, which is empty")
        with torch.no_grad(), Calibration():
            for ids in calibration:
                model(input_ids=torch.tensor([ids]))
    freeze(model)
    return Quantized(model, QUANTO)


register_method(
    QuantMethod(
        "quanto_w8a16",
        "optimum-quanto int8 weights, float activations",
        8,
        _quantize,
        QUANTO_PACKAGES,
        rows=(
            Row(
                "`quantize: {method: quanto_w8a16 \\| quanto_w4a16 \\| quanto_w8a8}`",
                ("calibration_windows",),
                "optimum-quanto; W8A8 calibrates activation scales on `calibration_windows` windows of the "
                "calibration split, `lm_head` kept "
                "float; saved as quanto's state dict + `quantization_map.json`",
            ),
        ),
    )
)
register_method(
    QuantMethod(
        "quanto_w4a16",
        "optimum-quanto int4 weights (groups of 64), float activations",
        4,
        _quantize,
        QUANTO_PACKAGES,
    )
)
register_method(
    QuantMethod(
        "quanto_w8a8",
        "optimum-quanto int8 weights + int8 activations with scales calibrated on the calibration split "
        "(lm_head kept float: its activations do not survive int8)",
        8,
        _quantize,
        QUANTO_PACKAGES,
        takes=("calibration_windows",),
        calibrates=True,
    )
)

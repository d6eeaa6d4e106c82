"""bitsandbytes: 4-bit NormalFloat / float weights (CPU backend here) and LLM.int8(), applied and saved through
transformers' `BitsAndBytesConfig`."""

from __future__ import annotations

from typing import Any

from tasks.techniques.quantize.methods import Quantized, QuantizeSettings, QuantMethod, register_method
from tasks.techniques.quantize.transformers_load import quantize_at_load
from tasks.techniques.registry import Row
from tasks.weights.transformers_quantized import TRANSFORMERS_QUANTIZED

BITSANDBYTES = ("accelerate", "bitsandbytes")


def _config(settings: QuantizeSettings) -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    if settings.method == "bnb_int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.method.removeprefix("bnb_"),
        bnb_4bit_use_double_quant=settings.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, settings.compute_dtype),
    )


def _quantize(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    return Quantized(quantize_at_load(model, _config(settings)), TRANSFORMERS_QUANTIZED)


FOUR_BIT_ROW = Row(
    "`quantize: {method: bnb_nf4 \\| bnb_fp4}`",
    ("double_quant", "compute_dtype"),
    "bitsandbytes 4-bit (CPU backend), saved through transformers",
)
for name, note, row in (
    ("bnb_nf4", "bitsandbytes 4-bit NormalFloat weights", (FOUR_BIT_ROW,)),
    ("bnb_fp4", "bitsandbytes 4-bit float weights", ()),
):
    register_method(
        QuantMethod(name, note, 4, _quantize, BITSANDBYTES, takes=("double_quant", "compute_dtype"), rows=row)
    )
register_method(
    QuantMethod(
        "bnb_int8",
        "bitsandbytes LLM.int8() (int8 weights, outlier features in 16-bit)",
        8,
        _quantize,
        BITSANDBYTES,
        rows=(Row("`quantize: {method: bnb_int8}`", (), "bitsandbytes LLM.int8()"),),
    )
)

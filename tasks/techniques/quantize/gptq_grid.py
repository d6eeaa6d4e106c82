"""GPTQ onto torchao's tinygemm int4 grid: llmopt's GPTQ (tasks/techniques/tinygemm_rounding.py) on the calibration
split puts each matrix's levels on the grid torchao's round-to-nearest lands on at load, so torchao's own kernel
runs GPTQ's integers (checked for every matrix at build)."""

from __future__ import annotations

from typing import Any

from tasks.techniques.quantize.methods import Quantized, QuantMethod, register_method
from tasks.techniques.quantize.torchao import TORCHAO, round_onto_torchao_grid, tinygemm_groups
from tasks.techniques.registry import Row
from tasks.weights.on_load import TINYGEMM_INT4


def _quantize(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    if not calibration:
        raise ValueError("method: torchao_int4_gptq calibrates on the calibration split, which is empty")
    return round_onto_torchao_grid(model, settings, calibration, progress)


register_method(
    QuantMethod(
        "torchao_int4_gptq",
        "GPTQ on the calibration split onto torchao's tinygemm int4 grid (torchao's rounding at load keeps "
        "GPTQ's integers), bfloat16 activations; stored as bfloat16 on the grid, packed when loaded",
        4,
        _quantize,
        TORCHAO,
        capability=(8, 0),
        takes=("group_size", "calibration_windows"),
        calibrates=True,
        on_load=TINYGEMM_INT4,
        check=tinygemm_groups,
        rows=(
            Row(
                "`quantize: {method: torchao_int4_gptq}`",
                ("group_size", "calibration_windows"),
                "GPTQ on the calibration split onto the same tinygemm grid: torchao's rounding at load stores "
                "GPTQ's integers (checked for every matrix at build); calibration and rounding run on the "
                "target's GPU",
            ),
        ),
    )
)

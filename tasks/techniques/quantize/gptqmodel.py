"""gptqmodel's GPTQ: its kernels and calibration are CUDA-only and its sdist does not build here, so llmopt does
not drive it; the method is named so that a params.yaml written for it gets a clear refusal and an alternative."""

from __future__ import annotations

from typing import Any

from tasks.techniques.quantize.methods import Quantized, QuantMethod, register_method
from tasks.techniques.registry import Row


def _quantize(model: Any, settings: Any, calibration: list[list[int]], progress: Any) -> Quantized:
    raise ValueError(f"method: {settings.method} cannot run on this target")  # refused by the target check


register_method(
    QuantMethod(
        "gptqmodel",
        "gptqmodel's GPTQ (CUDA only)",
        None,
        _quantize,
        ("gptqmodel",),
        devices=("cuda",),
        instead="gptqmodel's kernels and calibration are CUDA-only (its sdist does not build here); use "
        "onnx_genai int4 or quanto_w4a16 on cpu",
        takes=("bits", "group_size", "desc_act"),
        refused="gptqmodel is not driven by llmopt (it has no wheel here; its CUDA kernels build at install); use "
        "torchao_int4_gptq (llmopt's GPTQ onto torchao's int4 kernels)",
        rows=(
            Row(
                "`quantize: {method: gptqmodel}`",
                ("bits", "group_size", "desc_act"),
                "**GPU targets only**: gptqmodel's kernels and calibration need CUDA (its sdist does not build "
                "here); refused on `target.device: cpu` before any work",
            ),
        ),
    )
)

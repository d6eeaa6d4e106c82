"""`hf-quantized`: torchao or bitsandbytes weights saved through transformers, with `quantization_config` in
config.json; transformers reloads them with `from_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.weights.registry import WeightsFormat, register

if TYPE_CHECKING:
    from tasks.config import RuntimeSettings, TargetConfig

TRANSFORMERS_QUANTIZED = "hf-quantized"


@register
class TransformersQuantized(WeightsFormat):
    name = TRANSFORMERS_QUANTIZED

    def save(self, model: Any, dest: Path, dtype: str, record: dict[str, Any] | None) -> None:
        model.save_pretrained(dest)

    def load(self, folder: Path, dtype: str, settings: RuntimeSettings, target: TargetConfig) -> Any:
        from transformers import AutoModelForCausalLM

        # placed by transformers: bitsandbytes' packed weights are made for the device they are loaded onto
        placed = {"device_map": {"": target.device}} if target.device != "cpu" else {}
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=_quantized_dtype(folder, target.device), trust_remote_code=False, **placed
        )


def _quantized_dtype(folder: Path, device: str) -> Any:
    """The float dtype of a transformers-quantized model's unquantized parts: float32, except bitsandbytes 4-bit
    on a GPU, where they take the matmuls' compute dtype (as bitsandbytes is used there)."""
    import torch

    config = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    compute = config.get("bnb_4bit_compute_dtype") if config.get("load_in_4bit") else None
    return getattr(torch, compute) if device.startswith("cuda") and compute else torch.float32

"""How transformers applies a `quantization_config` (torchao, bitsandbytes): save the float model and reload it
with the config."""

from __future__ import annotations

import tempfile
from typing import Any


def quantize_at_load(model: Any, quantization_config: Any) -> Any:
    """Save the float model and reload it with `quantization_config`: how transformers applies these backends."""
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="llmopt-quantize-") as scratch:
        model.save_pretrained(scratch)
        return AutoModelForCausalLM.from_pretrained(
            scratch, quantization_config=quantization_config, dtype=torch.float32
        )

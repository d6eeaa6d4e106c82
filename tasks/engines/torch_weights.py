"""The weights formats the PyTorch engine loads, and how each is loaded (the build steps write them).

- `hf-safetensors`: a plain transformers folder (float weights), loaded with `from_pretrained`.
- `torch-dynamic-int8`: torch's dynamic int8 `nn.Linear` state dict beside the config (`model-dynamic-int8.pt`).
- `hf-quantized`: torchao or bitsandbytes, with `quantization_config` in config.json (transformers reloads it).
- `quanto`: optimum-quanto's state dict plus `quantization_map.json` (reloaded with `requantize`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from tasks.config import RuntimeSettings
from tasks.errors import ArtifactError, TargetError

HF_SAFETENSORS = "hf-safetensors"
TORCH_DYNAMIC = "torch-dynamic-int8"
TRANSFORMERS_QUANTIZED = "hf-quantized"
QUANTO = "quanto"
FORMATS = (HF_SAFETENSORS, TORCH_DYNAMIC, TRANSFORMERS_QUANTIZED, QUANTO)
TORCH_DYNAMIC_FILE = "model-dynamic-int8.pt"
QUANTO_MAP_FILE = "quantization_map.json"


def quantize_dynamic_int8(model: Any) -> Any:
    """int8 per-output-channel weights, activations quantized per batch at run time, for every nn.Linear.

    Per-channel weight scales: on SmolLM2 they cut the perplexity damage of per-tensor scales by ~15 %.
    """
    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def load_torch_model(folder: Path, weights_format: str, dtype: str, settings: RuntimeSettings) -> Any:
    """The model in `folder`, in eval mode, as its weights format and runtime settings ask."""
    import torch
    from transformers import AutoModelForCausalLM

    if weights_format == HF_SAFETENSORS:
        options = {"dtype": getattr(torch, dtype), "attn_implementation": settings.attn_implementation}
        if settings.sliding_window is not None:
            return _load_with_sliding_window(folder, settings.sliding_window, options)
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **options)
    if weights_format in (TORCH_DYNAMIC, TRANSFORMERS_QUANTIZED, QUANTO):
        return load_quantized(folder, weights_format)
    raise ArtifactError(f"{folder}: weights format {weights_format!r} unknown; known: {', '.join(FORMATS)}")


def load_quantized(folder: Path, weights_format: str) -> Any:
    """Rebuild a quantized model saved by `tasks.techniques.quantize.save_quantized`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if weights_format == TRANSFORMERS_QUANTIZED:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False)
    # A real (not meta) skeleton: non-persistent buffers such as rotary frequencies are not in the state dict.
    with no_init_weights():
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    if weights_format == TORCH_DYNAMIC:
        model = quantize_dynamic_int8(skeleton)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's TypedStorage notice for quantized tensors
            state = torch.load(folder / TORCH_DYNAMIC_FILE, weights_only=True)
        model.load_state_dict(state, strict=True)
        return model
    from optimum.quanto import requantize
    from safetensors.torch import load_file

    quantization = json.loads((folder / QUANTO_MAP_FILE).read_text())
    state = load_file(folder / "model.safetensors")
    requantize(skeleton, state, quantization, device=torch.device("cpu"))
    if not any(key.startswith("lm_head.") for key in state):  # saved tied: share the embeddings again
        skeleton.get_output_embeddings().weight = skeleton.get_input_embeddings().weight
    return skeleton


def _load_with_sliding_window(folder: Path, window: int, options: dict[str, Any]) -> Any:
    """A Llama with sliding-window attention is a Mistral: same weights and names, attention (and its KV cache)
    limited to the last `window` tokens."""
    from transformers import AutoConfig, MistralConfig, MistralForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in ("llama", "mistral"):
        raise TargetError(
            f"runtime.sliding_window: supported for Llama/Mistral models, not {config.model_type!r}"
        )
    fields = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("model_type", "architectures", "sliding_window")
    }
    return MistralForCausalLM.from_pretrained(
        folder, config=MistralConfig(**fields, sliding_window=window), **options
    )

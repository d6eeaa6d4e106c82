"""The weights formats the PyTorch engine loads, and how each is loaded (the build steps write them).

- `hf-safetensors`: a plain transformers folder (float weights), loaded with `from_pretrained`.
- `torch-dynamic-int8`: torch's dynamic int8 `nn.Linear` state dict beside the config (`model-dynamic-int8.pt`).
- `hf-quantized`: torchao or bitsandbytes, with `quantization_config` in config.json (transformers reloads it).
- `quanto`: optimum-quanto's state dict plus `quantization_map.json` (reloaded with `requantize`).
- `hf-quantize-on-load`: a bfloat16 transformers folder whose matrices torchao quantizes when the variant is loaded
  on its device (`quantize-on-load.json` says how). torchao's int4 (tinygemm) and FP8 kernels pack weights for the
  device they run on: tile-packed int4 and FP8 only on a CUDA GPU, int4 for the CPU's kernel on a CPU. The folder
  holds the weights on the grid torchao's round-to-nearest lands on (GPTQ's levels survive it), so what is stored
  is what runs; the packed bytes are what `quantize-on-load.json` counts for the roofline.
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
ON_LOAD = "hf-quantize-on-load"
FORMATS = (HF_SAFETENSORS, TORCH_DYNAMIC, TRANSFORMERS_QUANTIZED, QUANTO, ON_LOAD)
TORCH_DYNAMIC_FILE = "model-dynamic-int8.pt"
QUANTO_MAP_FILE = "quantization_map.json"
ON_LOAD_FILE = "quantize-on-load.json"
# torchao kernels behind the on-load methods, and the devices each packs for (tinygemm int4: tile-packed on CUDA,
# the CPU's own int4 pack on a CPU, the same grid; FP8 rows: CUDA only)
ON_LOAD_KERNELS = {"tinygemm_int4": ("cpu", "cuda"), "fp8_per_row": ("cuda",)}


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


def load_torch_model(
    folder: Path,
    weights_format: str,
    dtype: str,
    settings: RuntimeSettings,
    device: str = "cpu",
    tensor_parallel: int = 1,
) -> Any:
    """The model in `folder` on `device`, as its weights format and runtime settings ask; with `tensor_parallel`
    > 1, this rank's shard of it (the process group is already joined)."""
    import torch
    from transformers import AutoModelForCausalLM

    if weights_format == HF_SAFETENSORS:
        options = {"dtype": getattr(torch, dtype), "attn_implementation": settings.attn_implementation}
        if tensor_parallel > 1:
            from transformers.distributed import DistributedConfig

            split = DistributedConfig(tp_size=tensor_parallel)
            return AutoModelForCausalLM.from_pretrained(folder, distributed_config=split, **options)
        if settings.sliding_window is not None:
            return _load_with_sliding_window(folder, settings.sliding_window, options).to(device)
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **options).to(device)
    if tensor_parallel > 1:
        raise TargetError(f"tensor parallelism splits float weights, not {weights_format} ones")
    if weights_format in (TORCH_DYNAMIC, TRANSFORMERS_QUANTIZED, QUANTO, ON_LOAD):
        return load_quantized(folder, weights_format, device)
    raise ArtifactError(f"{folder}: weights format {weights_format!r} unknown; known: {', '.join(FORMATS)}")


def load_quantized(folder: Path, weights_format: str, device: str = "cpu") -> Any:
    """Rebuild a quantized model saved by `tasks.techniques.quantize.save_quantized`, on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if weights_format == TRANSFORMERS_QUANTIZED:
        # placed by transformers: bitsandbytes' packed weights are made for the device they are loaded onto
        placed = {"device_map": {"": device}} if device != "cpu" else {}
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=_quantized_dtype(folder, device), trust_remote_code=False, **placed
        )
    if weights_format == ON_LOAD:
        return load_quantize_on_load(folder, device)
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
    return skeleton.to(device)


def _quantized_dtype(folder: Path, device: str) -> Any:
    """The float dtype of a transformers-quantized model's unquantized parts: float32, except bitsandbytes 4-bit
    on a GPU, where they take the matmuls' compute dtype (as bitsandbytes is used there)."""
    import torch

    config = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    compute = config.get("bnb_4bit_compute_dtype") if config.get("load_in_4bit") else None
    return getattr(torch, compute) if device.startswith("cuda") and compute else torch.float32


def on_load_config(record: dict[str, Any], device: str) -> Any:
    """The torchao config an on-load record names, for `device` (the kernel packs for it)."""
    kernel = record["kernel"]
    if device.partition(":")[0] not in ON_LOAD_KERNELS[kernel]:
        raise TargetError(
            f"{kernel} runs on {', '.join(ON_LOAD_KERNELS[kernel])}, not {device} (torchao packs it for the device)"
        )
    if kernel == "fp8_per_row":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if device.startswith("cuda"):
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(group_size=record["group_size"], int4_packing_format="tile_packed_to_4d")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=record["group_size"])


def on_load_modules(model: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The linear layers an on-load record quantizes: every nn.Linear whose input splits into whole groups (FP8:
    16) and whose outputs are a multiple of 16 (the CPU's int4 pack and FP8 need it; the same layers on every
    device), except an output layer that shares its table with the embedding lookup."""
    import torch

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    multiple = record.get("group_size", 16)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module.in_features % multiple == 0
        and module.out_features % 16 == 0
        and not (tied and module is model.get_output_embeddings())
    }


def load_quantize_on_load(folder: Path, device: str) -> Any:
    """The bfloat16 folder on `device`, its matrices quantized there by torchao as `quantize-on-load.json` says.
    Read on the host and packed one matrix at a time on the device, so the device never holds the whole bfloat16
    model (the first H200 check moved it whole and packed in place: a peak of 4.5 GB for a 0.5 GB int4 model whose
    bfloat16 form is 1.9 GB; this order has not been measured on a GPU yet)."""
    import torch
    from torchao.quantization import quantize_
    from transformers import AutoModelForCausalLM

    record = json.loads((folder / ON_LOAD_FILE).read_text())
    config = on_load_config(record, device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, trust_remote_code=False)
    for module in dict.fromkeys(on_load_modules(model, record).values()):  # each matrix once, in model order
        quantize_(module.to(device), config)
    return model.to(device)


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

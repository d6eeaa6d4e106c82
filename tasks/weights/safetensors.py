"""`hf-safetensors`: a plain transformers folder of float weights in the variant's runtime dtype, loaded with
`from_pretrained` (split over ranks for tensor parallelism; as a Mistral for a sliding window)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import TargetError
from tasks.weights.registry import WeightsFormat, register

if TYPE_CHECKING:
    from tasks.config import RuntimeSettings, TargetConfig

HF_SAFETENSORS = "hf-safetensors"


@register
class Safetensors(WeightsFormat):
    name = HF_SAFETENSORS
    splits = True

    def save(self, model: Any, dest: Path, dtype: str, record: dict[str, Any] | None) -> None:
        import torch

        model.to(getattr(torch, dtype)).save_pretrained(dest)

    def load(self, folder: Path, dtype: str, settings: RuntimeSettings, target: TargetConfig) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        options = {"dtype": getattr(torch, dtype), "attn_implementation": settings.attn_implementation}
        if target.tensor_parallel > 1:
            from transformers.distributed import DistributedConfig

            split = DistributedConfig(tp_size=target.tensor_parallel)
            return AutoModelForCausalLM.from_pretrained(folder, distributed_config=split, **options)
        if settings.sliding_window is not None:
            return _load_with_sliding_window(folder, settings.sliding_window, options).to(target.device)
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **options).to(
            target.device
        )


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

"""The torch engine's KV-cache settings: the `generate` options for a static or quantized cache, the same quantized
cache for a sequence outside `generate` (the server's decoder, long-context measurements), and a cache's bytes."""

from __future__ import annotations

from typing import Any

from tasks.config import RuntimeSettings

KV_RESIDUAL_TOKENS = (
    16  # a quantized KV cache keeps only the newest tokens in full precision (KIVI's residual)
)


def generation_options(settings: RuntimeSettings, head_dim: int) -> dict[str, Any]:
    """`generate` keyword arguments for the KV-cache settings (a sliding window is part of the model instead).
    transformers compiles a static cache's decode step on a GPU by itself; llmopt never lets it: `compile: true`
    runs llmopt's own decode loop instead (tasks/engines/pytorch/decode_loop.py), so what is measured is what the
    recipe names."""
    if settings.kv_cache == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    if settings.kv_cache == "quantized":
        cache = {"backend": "quanto", "nbits": settings.kv_cache_bits, "residual_length": KV_RESIDUAL_TOKENS}
        return {
            "cache_implementation": "quantized",
            "cache_config": {**cache, "q_group_size": min(64, head_dim)},
        }
    return {}


def cache_factory(options: dict[str, Any], config: Any) -> Any:
    """A callable making a fresh KV cache of the recipe's kind for one sequence outside `generate`: transformers'
    quantized cache for `kv_cache: quantized` (as `generate` builds it from the same options), else None (the
    model's own dynamic cache, windowed where the model is)."""
    if options.get("cache_implementation") != "quantized":
        return lambda: None
    from transformers import QuantizedCache

    return lambda: QuantizedCache(config=config, **options["cache_config"])


def kv_cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers KV cache, packed quantized tensors counted by their parts."""
    return sum(_tensor_bytes(value) for layer in cache.layers for value in vars(layer).values())


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        if hasattr(value, "__tensor_flatten__"):  # quanto's packed tensors: data, scale, shift
            names, _ = value.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(value, name)) for name in names)
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0

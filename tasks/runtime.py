"""The one Runtime interface: evaluation, benchmark and serving all load variants through it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tasks.config import RuntimeSettings
from tasks.errors import ModelSourceError, TargetError
from tasks.manifest import VariantManifest, read_manifest


class Runtime(Protocol):
    """An engine holding one variant: tokenize, score token sequences, generate continuations."""

    manifest: VariantManifest

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        """(sum of next-token negative log-likelihoods, number of predicted tokens) per sequence."""
        ...

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True
    ) -> list[list[int]]:
        """Greedy continuation token ids (prompt excluded) for each prompt; prompts of equal length run as one
        batch."""
        ...


def load_runtime(folder: Path, threads: int) -> Runtime:
    """Open the variant in `folder` with the engine its manifest names (`threads` unless the recipe sets them)."""
    manifest = read_manifest(folder)
    engines = {"torch": TorchRuntime, "onnxruntime-genai": OrtGenAIRuntime}
    if manifest.engine not in engines:
        raise ModelSourceError(f"{folder}: engine {manifest.engine!r} unknown; known: {', '.join(engines)}")
    return engines[manifest.engine](folder, manifest, runtime_settings(manifest).threads or threads)


def runtime_settings(manifest: VariantManifest) -> RuntimeSettings:
    """The recipe's runtime settings, as validated when the variant was built."""
    return RuntimeSettings.model_validate(manifest.recipe.get("runtime", {}))


KV_RESIDUAL_TOKENS = (
    16  # a quantized KV cache keeps only the newest tokens in full precision (KIVI's residual)
)


def generation_options(settings: RuntimeSettings, head_dim: int) -> dict[str, Any]:
    """`generate` keyword arguments for the KV-cache setting (a sliding window is part of the model instead)."""
    if settings.kv_cache == "static":
        return {"cache_implementation": "static"}
    if settings.kv_cache == "quantized":
        cache = {
            "backend": "quanto",
            "nbits": settings.kv_cache_bits or 4,
            "residual_length": KV_RESIDUAL_TOKENS,
        }
        return {
            "cache_implementation": "quantized",
            "cache_config": {**cache, "q_group_size": min(64, head_dim)},
        }
    return {}


class _HFTokenizer:
    """Every engine tokenizes with the variant's Hugging Face tokenizer, so token counts pair across engines."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TorchRuntime(_HFTokenizer):
    """PyTorch + transformers eager execution on CPU."""

    def __init__(self, folder: Path, manifest: VariantManifest, threads: int) -> None:
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(threads)
        self.manifest = manifest
        settings = runtime_settings(manifest)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            self.model = _load_torch_model(folder, manifest, settings)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelSourceError(f"{folder}: cannot load weights ({str(exc).splitlines()[0]})") from exc
        self.model.eval()
        if settings.engine == "deepspeed":
            self.model = deepspeed_engine(self.model, manifest.dtype)
        elif settings.engine == "tensorrt_llm":
            raise TargetError("engine tensorrt_llm needs an NVIDIA GPU target; on cpu use onnx_genai")
        self._options = generation_options(settings, self.model.config.head_dim)
        # quanto's packed int4 tensors fail under inference_mode ("Cannot set version_counter"); no_grad works
        self._no_grad = torch.no_grad if manifest.weights_format == "quanto" else torch.inference_mode

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        import torch

        results = []
        with self._no_grad():
            for ids in sequences:
                tensor = torch.tensor([ids])
                logits = self.model(input_ids=tensor).logits[0, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits, tensor[0, 1:], reduction="sum")
                results.append((float(nll), len(ids) - 1))
        return results

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True
    ) -> list[list[int]]:
        return _batched_by_length(
            prompts, lambda batch: self._generate_batch(batch, max_new_tokens, stop_at_eos)
        )

    def _generate_batch(
        self, batch: list[list[int]], max_new_tokens: int, stop_at_eos: bool
    ) -> list[list[int]]:
        import torch

        extra: dict[str, Any] = {} if stop_at_eos else {"min_new_tokens": max_new_tokens}
        with self._no_grad():
            generated = self.model.generate(
                input_ids=torch.tensor(batch),
                attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                **self._options,
                **extra,
            )
        rows = generated[:, len(batch[0]) :].tolist()
        return [_cut_after_eos(row, self.tokenizer.eos_token_id) if stop_at_eos else row for row in rows]


class OrtGenAIRuntime(_HFTokenizer):
    """ONNX Runtime GenAI: the model builder's graph with its KV cache and MatMulNBits kernels."""

    def __init__(self, folder: Path, manifest: VariantManifest, threads: int) -> None:
        import onnxruntime_genai as og
        from transformers import AutoTokenizer

        self.manifest = manifest
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        config = og.Config(str(folder))
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}})
        )
        try:
            self.model = og.Model(config)
        except Exception as exc:  # onnxruntime_genai raises plain RuntimeError/OrtException subclasses
            raise ModelSourceError(
                f"{folder}: cannot load the ONNX model ({str(exc).splitlines()[0]})"
            ) from exc
        self._og = og

    def _generator(self, batch: list[list[int]], max_length: int, min_length: int = 0) -> Any:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(
            batch_size=len(batch), max_length=max_length, min_length=min_length, do_sample=False
        )
        generator = self._og.Generator(self.model, params)
        generator.append_tokens(np.asarray(batch, dtype=np.int32))
        return generator

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        results = []
        for ids in sequences:
            logits = self._generator([ids], len(ids) + 1).get_output("logits")[0, :-1].astype(np.float64)
            shifted = logits - logits.max(axis=-1, keepdims=True)
            log_norm = np.log(np.exp(shifted).sum(axis=-1))
            targets = np.asarray(ids[1:])
            nll = float((log_norm - shifted[np.arange(len(targets)), targets]).sum())
            results.append((nll, len(ids) - 1))
        return results

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True
    ) -> list[list[int]]:
        return _batched_by_length(
            prompts, lambda batch: self._generate_batch(batch, max_new_tokens, stop_at_eos)
        )

    def _generate_batch(
        self, batch: list[list[int]], max_new_tokens: int, stop_at_eos: bool
    ) -> list[list[int]]:
        length = len(batch[0]) + max_new_tokens
        generator = self._generator(batch, length, min_length=0 if stop_at_eos else length)
        rows: list[list[int]] = [[] for _ in batch]
        while not generator.is_done() and len(rows[0]) < max_new_tokens:
            generator.generate_next_token()
            for row, token in zip(rows, generator.get_next_tokens(), strict=True):
                row.append(int(token))
        return [_cut_after_eos(row, self.tokenizer.eos_token_id) if stop_at_eos else row for row in rows]


def _batched_by_length(
    prompts: list[list[int]], run_batch: Callable[[list[list[int]]], list[list[int]]]
) -> list[list[int]]:
    """Run prompts of equal length together as one batch (no padding, so a prompt's continuation does not
    depend on its batch mates); results come back in the order of `prompts`."""
    if any(not prompt for prompt in prompts):
        raise ValueError("cannot generate from an empty prompt")
    groups: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(index)
    outputs: list[list[int]] = [[] for _ in prompts]
    for indexes in groups.values():
        for index, row in zip(indexes, run_batch([prompts[i] for i in indexes]), strict=True):
            outputs[index] = row
    return outputs


def _cut_after_eos(tokens: list[int], eos: int | None) -> list[int]:
    """A finished sequence in a batch keeps being padded; keep it up to and including its end-of-sequence token."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def _load_torch_model(folder: Path, manifest: VariantManifest, settings: RuntimeSettings) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, manifest.dtype)
    if manifest.weights_format == "hf-safetensors":
        options = {"dtype": dtype, "attn_implementation": settings.attention or "sdpa"}
        if settings.sliding_window is not None:
            return _load_with_sliding_window(folder, settings.sliding_window, options)
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **options)
    if manifest.weights_format in ("torch-dynamic-int8", "hf-quantized", "quanto"):
        from tasks.quantize import load_quantized

        return load_quantized(folder, manifest.weights_format)
    raise ModelSourceError(f"{folder}: weights format {manifest.weights_format!r} unknown")


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


def deepspeed_engine(model: Any, dtype: str) -> Any:
    """DeepSpeed's inference engine around the model at world size 1 (the target check refuses more ranks on
    CPU; no kernel injection: CPU has no kernels); generate goes through the wrapped module."""
    import os

    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    engine = deepspeed.init_inference(
        model, dtype=getattr(torch, dtype), replace_with_kernel_inject=False, tensor_parallel={"tp_size": 1}
    )
    return engine.module

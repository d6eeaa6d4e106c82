"""The one Runtime interface: evaluation, benchmark and serving all load variants through it."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tasks.errors import ModelSourceError
from tasks.manifest import VariantManifest, read_manifest

QUANTIZED_STATE_FILE = "model-dynamic-int8.pt"


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
    """Open the variant in `folder` with the engine its manifest names."""
    manifest = read_manifest(folder)
    engines = {"torch": TorchRuntime, "onnxruntime-genai": OrtGenAIRuntime}
    if manifest.engine not in engines:
        raise ModelSourceError(f"{folder}: engine {manifest.engine!r} unknown; known: {', '.join(engines)}")
    return engines[manifest.engine](folder, manifest, threads)


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
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            self.model = _load_torch_model(folder, manifest)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelSourceError(f"{folder}: cannot load weights ({str(exc).splitlines()[0]})") from exc
        self.model.eval()

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        import torch

        results = []
        with torch.inference_mode():
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
        with torch.inference_mode():
            generated = self.model.generate(
                input_ids=torch.tensor(batch),
                attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
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


def _load_torch_model(folder: Path, manifest: VariantManifest) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    dtype = getattr(torch, manifest.dtype)
    if manifest.weights_format == "hf-safetensors":
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False)
    if manifest.weights_format == "torch-dynamic-int8":
        from tasks.optimize import quantize_dynamic_int8

        # A real (not meta) skeleton: non-persistent buffers such as rotary frequencies are not in the state dict.
        with no_init_weights():
            skeleton = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(folder), dtype=torch.float32
            )
        model = quantize_dynamic_int8(skeleton)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's TypedStorage notice for quantized tensors
            state = torch.load(folder / QUANTIZED_STATE_FILE, weights_only=True)
        model.load_state_dict(state, strict=True)
        return model
    raise ModelSourceError(f"{folder}: weights format {manifest.weights_format!r} unknown")

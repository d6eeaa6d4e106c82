"""The ONNX Runtime GenAI engine: the model builder's graph with its KV cache and MatMulNBits kernels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tasks.engines.contract import Runtime
from tasks.engines.manifest import VariantManifest
from tasks.errors import ModelSourceError

ENGINE = "onnxruntime-genai"
ONNX_GENAI = "onnx-genai"  # the weights format: the builder's output folder (genai_config.json, model.onnx …)


class OrtGenAIRuntime(Runtime):
    """ONNX Runtime GenAI's `og.Model`, driven through `og.Generator` (not thread-safe: one caller at a time)."""

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
        self.context_length = json.loads((folder / "genai_config.json").read_text())["model"][
            "context_length"
        ]

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
            targets = np.asarray(ids[1:], dtype=np.int64)
            nll = float((log_norm - shifted[np.arange(len(targets)), targets]).sum())
            results.append((nll, len(ids) - 1))
        return results

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
        return rows

"""The ONNX Runtime GenAI engine: the model builder's graph with its KV cache and MatMulNBits kernels."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import TargetConfig
from tasks.engines.contract import Runtime, next_token_nll
from tasks.engines.manifest import VariantManifest
from tasks.engines.onnx.batch import OrtBatchDecoder
from tasks.engines.onnx.errors import engine_says
from tasks.engines.onnx.float_prompts import FLOAT_PROMPT_TOKENS
from tasks.engines.registry import register_engine
from tasks.errors import ArtifactUnreadable

ENGINE = "onnxruntime-genai"
UNDECIDED: Any = False  # a runtime whose decoders' prompt paths are not chosen yet
ONNX_GENAI = "onnx-genai"  # the weights format: the builder's output folder (genai_config.json, model.onnx …)


@register_engine
class OrtGenAIRuntime(Runtime):
    """ONNX Runtime GenAI's `og.Model`, driven through `og.Generator` (not thread-safe: one caller at a time)."""

    ENGINE = ENGINE
    LIBRARIES = ("onnxruntime-genai",)

    def __init__(self, folder: Path, manifest: VariantManifest, target: TargetConfig) -> None:
        import onnxruntime_genai as og
        from transformers import AutoTokenizer

        self.manifest = manifest
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        config = og.Config(str(folder))
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": target.threads}}}})
        )
        try:
            self.model = og.Model(config)
        except Exception as exc:  # onnxruntime_genai raises plain RuntimeError/OrtException subclasses
            raise ArtifactUnreadable(
                f"{folder}: ONNX Runtime cannot load this model: {engine_says(exc)}"
            ) from exc
        self._og = og
        self._folder, self._threads = folder, target.threads
        self._bf16: Any = UNDECIDED  # the bfloat16 prompt path of its decoders (BfloatPrompts), or None
        self._float_from: Any = UNDECIDED  # from which length their prompt slices run with float activations
        self._deciding = threading.Lock()
        self.context_length = json.loads((folder / "genai_config.json").read_text())["model"][
            "context_length"
        ]

    def batch_decoder(self) -> OrtBatchDecoder:
        """The server's decoder; the first one made decides, once per runtime, from which length prompt slices run
        with float activations (`float_from`) and whether long ones run in bfloat16 (`faster_in_bf16`): where the
        graph rounds activations to int8 anyway, and where it pays here."""
        decoder = json.loads((self._folder / "genai_config.json").read_text())["model"]["decoder"]
        shape = (decoder["num_key_value_heads"], decoder["head_size"])
        path = self._folder / decoder["filename"]
        with self._deciding:  # one probe at a time: two at once would time each other
            float_from = FLOAT_PROMPT_TOKENS if self._float_from is UNDECIDED else self._float_from
            made = OrtBatchDecoder(path, shape, self._threads, bf16=self._bf16 or None, float_from=float_from)
            # first: the bfloat16 probe compares with the ONNX path a slice of its length takes; a decoder that had
            # no room for a float session leaves the question to the next one
            if self._float_from is UNDECIDED and made.float_session:
                self._float_from = made.choose_float_from(self.context_length)
            if self._bf16 is UNDECIDED:
                self._bf16 = made.choose_bf16()
        return made

    def suppressed_at_length(self, stop_at_eos: bool) -> frozenset[int]:
        if stop_at_eos:
            return frozenset()
        eos = json.loads((self._folder / "genai_config.json").read_text())["model"].get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]  # what `min_length` bars
        return frozenset(ids)

    def sequence(self, capacity: int) -> OrtSequence:
        layers = json.loads((self._folder / "genai_config.json").read_text())["model"]["decoder"][
            "num_hidden_layers"
        ]
        return OrtSequence(self._generator([[]], min(capacity, self.context_length)), layers)

    def _generator(self, batch: list[list[int]], max_length: int, min_length: int = 0) -> Any:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(
            batch_size=len(batch), max_length=max_length, min_length=min_length, do_sample=False
        )
        generator = self._og.Generator(self.model, params)
        if batch[0]:
            generator.append_tokens(np.asarray(batch, dtype=np.int32))
        return generator

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        return [next_token_nll(self.position_logits(ids), ids) for ids in sequences]

    def position_logits(self, ids: list[int]) -> Any:
        return self._generator([ids], len(ids) + 1).get_output("logits")[0]

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
            if len(rows[0]) == 1:
                self._first_tokens()
        return rows


class OrtSequence:
    """One sequence in an `og.Generator`: several tokens appended per call with the logits of each, and
    `rewind_to` on rewind (speculative decoding). The graph runs k new tokens with other kernels than one (int4
    MatMulNBits), so a k-token call's logits can differ from one-token calls' in the last digits."""

    def __init__(self, generator: Any, layers: int = 0) -> None:
        self._generator, self.length, self._layers = generator, 0, layers

    def kv_bytes(self) -> int:
        """Bytes of the generator's KV buffers: the first layer's present keys and values as ONNX Runtime holds
        them (their shape and element type; every layer is alike), times the layers."""
        key, value = (self._generator.get_output(f"present.0.{part}") for part in ("key", "value"))
        return (key.nbytes + value.nbytes) * self._layers

    def extend(self, tokens: list[int], every: bool = True) -> np.ndarray:
        self._generator.append_tokens(np.asarray([tokens], dtype=np.int32))
        self.length += len(tokens)
        logits = self._generator.get_output("logits")[0]  # the graph computes every row
        return np.asarray(logits if every else logits[-1:], dtype=np.float32)

    def rewind(self, length: int) -> None:
        if length < self.length:
            self._generator.rewind_to(length)
            self.length = length

"""The llama.cpp engine: a GGUF file run by llama.cpp through llama-cpp-python's C API (no Python sampling layer).

Scoring asks llama.cpp for the logits of every position; generation and serving put several sequences into one
`llama_decode` batch (each with its own `seq_id` and positions), so sequences of different lengths step together
exactly: llama.cpp's attention mask keeps every sequence to its own cache cells. Batched generation and the
server's decoder give each sequence a KV stream of its own (see `LlamaCppBatchDecoder`); scoring and one sequence
use one cache.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import TargetConfig
from tasks.engines.contract import Runtime, next_token_nll
from tasks.engines.llama_cpp.batch import LlamaCppBatchDecoder
from tasks.engines.manifest import VariantManifest
from tasks.engines.registry import register_engine
from tasks.errors import ArtifactUnreadable, EngineError

ENGINE = "llama.cpp"
GGUF = "gguf"  # the weights format: model.gguf beside the Hugging Face tokenizer
MODEL_FILE = "model.gguf"
_COMPUTE = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmopt-llama.cpp")
UBATCH = 512  # tokens llama.cpp computes at once (its default; bounds the compute buffers)
KV_BYTES_PER_VALUE = {"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}  # runtime.kv_cache_type

_init_lock = threading.Lock()
_quiet_callback: Any = None  # kept referenced: llama.cpp calls it for the life of the process
_ERROR = 4  # GGML_LOG_LEVEL_ERROR
_errors: collections.deque[str] = collections.deque(
    maxlen=16
)  # llama.cpp's latest error lines (its log is silent)


def llama_cpp_module() -> Any:
    """llama_cpp's C bindings, the backend initialised once per process and its log kept off stderr."""
    global _quiet_callback
    try:
        import llama_cpp
    except ImportError as exc:  # an install without the source-built wheel (make install builds it)
        raise EngineError(
            "the llama.cpp engine needs llama-cpp-python; run `make install` (it builds the wheel once per "
            f"machine) ({exc})"
        ) from exc
    with _init_lock:
        if _quiet_callback is None:
            _quiet_callback = llama_cpp.llama_log_callback(_quiet)
            llama_cpp.llama_log_set(_quiet_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
    return llama_cpp


def _quiet(level: int, text: bytes, user_data: Any) -> None:
    if level == _ERROR:
        _errors.append(text.decode(errors="replace").strip())


def engine_says() -> str:
    """llama.cpp's first error line since the last call, without its function name: its own words for why a
    file did not load ("invalid magic characters: 'XXXX', expected 'GGUF'", "tensor 'token_embd.weight' data is
    not within the file bounds, model is corrupted or incomplete"); '' when it logged none."""
    lines = [line for line in list(_errors) if line]
    _errors.clear()
    if not lines:
        return ""
    first = re.sub(r"^\w+: ", "", lines[0])
    return re.sub(r"^error loading model: ", "", first)


class GgufModel:
    """A llama_model loaded from a GGUF file (CPU, memory-mapped), freed when the last context using it is gone."""

    def __init__(self, path: Path, kv_cache_type: str = "f16") -> None:
        self._lib = llama_cpp_module()
        self.kv_cache_type = kv_cache_type  # its contexts' key and value cache type (runtime.kv_cache_type)
        params = self._lib.llama_model_default_params()
        params.n_gpu_layers = 0
        with _init_lock:  # one load at a time: the error lines read are this load's
            engine_says()  # forget what earlier calls logged
            self.pointer = self._lib.llama_model_load_from_file(str(path).encode(), params)
            said = "" if self.pointer else engine_says() or "damaged or an unknown format"
        if not self.pointer:
            raise ArtifactUnreadable(f"{path}: llama.cpp cannot load this GGUF file: {said}")
        self.n_vocab = self._lib.llama_vocab_n_tokens(self._lib.llama_model_get_vocab(self.pointer))
        self.n_ctx_train = int(self._lib.llama_model_n_ctx_train(self.pointer))
        lib, model = self._lib, self.pointer
        # the keys and values of one token in the cache: f16, or blocks of 32 values in 34 (q8_0) or 18 bytes (q4_0)
        self.kv_bytes_per_token = int(
            lib.llama_model_n_layer(model)
            * 2
            * KV_BYTES_PER_VALUE[kv_cache_type]
            * lib.llama_model_n_head_kv(model)
            * (lib.llama_model_n_embd(model) // max(lib.llama_model_n_head(model), 1))
        )

    def __del__(self) -> None:
        if getattr(self, "pointer", None):
            try:  # noqa: SIM105 (contextlib itself may be torn down at interpreter exit)
                self._lib.llama_model_free(self.pointer)
            except Exception:  # at interpreter exit the bindings may be gone already
                pass
            self.pointer = None


@register_engine
class LlamaCppRuntime(Runtime):
    """One GGUF model; a llama.cpp context per call shape, kept while the next call fits in it."""

    ENGINE = ENGINE
    LIBRARIES = ("llama-cpp-python",)

    def __init__(self, folder: Path, manifest: VariantManifest, target: TargetConfig) -> None:
        from transformers import AutoTokenizer

        self.manifest = manifest
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self._model = GgufModel(folder / MODEL_FILE, manifest.runtime_settings().kv_cache_type)
        self._threads = target.threads
        self.context_length = self._model.n_ctx_train
        self._context: _Context | None = None

    def context(self, cells: int, sequences: int, streams: bool = False) -> _Context:
        """A context with at least `cells` KV cells for `sequences` sequence ids, its KV cache cleared; with
        `streams`, `cells` for each sequence in a KV stream of its own (one context is kept: the last made)."""
        current = self._context
        room = current.cells // current.sequences if current is not None and streams else None
        if (
            current is None
            or current.unified == streams
            or sequences > current.sequences
            or cells > (room if streams else current.cells)
        ):
            self._context = None  # free the old one first (peak memory)
            if streams:  # each stream to llama.cpp's padding (256 cells), with room to grow
                cells = sequences * min(-(-(cells + 64) // 256) * 256, max(self.context_length, cells))
            else:
                cells = min(_room_for(cells), max(self.context_length * sequences, cells))
            self._context = _Context(self._model, cells, sequences, self._threads, unified=not streams)
        self._context.clear()
        return self._context

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        results = []
        for ids in sequences:
            if len(ids) < 2:
                results.append((0.0, 0))
                continue
            results.append(next_token_nll(self.position_logits(ids), ids))
        return results

    def position_logits(self, ids: list[int]) -> Any:
        (logits,) = self.context(len(ids), 1).decode([(0, ids, 0, True)])
        return logits

    def _generate_batch(
        self, batch: list[list[int]], max_new_tokens: int, stop_at_eos: bool
    ) -> list[list[int]]:
        length = len(batch[0])
        # a stream per row: in one cache every row's attention spans every row's cells (masked), and 8 rows of 128 + 64
        # tokens stepped in 45-48 ms there against 30-33 in streams here (the server's decoder does the same)
        context = self.context(length + max_new_tokens, len(batch), streams=len(batch) > 1)
        logits = context.decode([(seq, prompt, 0, False) for seq, prompt in enumerate(batch)])
        rows: list[list[int]] = [[] for _ in batch]
        for step in range(max_new_tokens):
            tokens = [int(np.argmax(row[-1])) for row in logits]
            for row, token in zip(rows, tokens, strict=True):
                row.append(token)
            if step == 0:
                self._first_tokens()
            finished = stop_at_eos and all(self.eos_token_id in row for row in rows)
            if step == max_new_tokens - 1 or finished:
                break
            logits = context.decode(
                [(seq, [token], length + step, False) for seq, token in enumerate(tokens)]
            )
        return rows

    def sequence(self, capacity: int) -> LlamaCppSequence:
        return LlamaCppSequence(self.context(capacity, 1))

    def batch_decoder(self) -> LlamaCppBatchDecoder:
        return LlamaCppBatchDecoder(self)

    def streams(self, sequences: int, tokens: int) -> _Context:
        """A context of `sequences` KV streams of `tokens` cells each (the server's decoder)."""
        return _Context(self._model, sequences * tokens, sequences, self._threads, unified=False)


class _Context:
    """A llama_context and a reusable llama_batch (CPU, f16 cache like llama.cpp's default). `unified`: every
    sequence's cells in one cache; else one stream of cells / sequences cells per sequence id, as llama-server's
    slots (each token then attends over its own sequence's cells only, not over every sequence's)."""

    def __init__(
        self, model: GgufModel, cells: int, sequences: int, threads: int, unified: bool = True
    ) -> None:
        lib = self._lib = llama_cpp_module()
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = cells  # a whole prompt (or window) fits in one llama_decode call ...
        params.n_ubatch = min(cells, UBATCH)  # ... which llama.cpp runs in chunks of this many tokens
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = unified
        if model.kv_cache_type != "f16":  # llama.cpp quantizes the V cache only with flash attention on
            params.type_k = params.type_v = getattr(lib, f"GGML_TYPE_{model.kv_cache_type.upper()}")
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self.cells, self.sequences, self.unified = cells, sequences, unified
        self._model = model  # keeps the model alive while this context uses it
        engine_says()  # forget what earlier calls logged
        self._ctx = lib.llama_init_from_model(model.pointer, params)
        if not self._ctx:
            said = engine_says()  # e.g. a quantized cache type the model's head width cannot take
            raise EngineError(
                f"llama.cpp could not create a context of {cells} tokens{': ' + said if said else ''}"
            )
        self._vocab = model.n_vocab
        self._batch = lib.llama_batch_init(cells, 0, 1)
        self._memory = lib.llama_get_memory(self._ctx)

    def __del__(self) -> None:
        if getattr(self, "_ctx", None):
            try:  # noqa: SIM105 (contextlib itself may be torn down at interpreter exit)
                self._lib.llama_batch_free(self._batch)
                self._lib.llama_free(self._ctx)
            except Exception:  # at interpreter exit the bindings may be gone already
                pass
            self._ctx = None

    def clear(self) -> None:
        self._lib.llama_memory_clear(self._memory, True)

    def forget(self, sequence: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, sequence, -1, -1)

    def truncate(self, sequence: int, length: int) -> None:
        """Free `sequence`'s cells from position `length` on (an error where the cache cannot drop a tail)."""
        if not self._lib.llama_memory_seq_rm(self._memory, sequence, length, -1):
            raise EngineError(f"llama.cpp cannot rewind this model's cache to {length} tokens")

    def share(self, source: int, target: int, length: int) -> None:
        """Give `target` the cache cells of `source`'s first `length` positions, nothing recomputed: all of
        `source`'s, then the rest dropped (across streams llama.cpp copies only whole ones, in its next decode; a
        unified cache shares the cells themselves)."""
        self._lib.llama_memory_seq_cp(self._memory, source, target, 0, -1)
        self.truncate(target, length)

    def save(self, sequence: int) -> Any:
        """A copy of `sequence`'s cells in this process's memory (its keys and values, only the cells it uses)."""
        size = self._lib.llama_state_seq_get_size(self._ctx, sequence)
        data = (ctypes.c_uint8 * size)()
        if self._lib.llama_state_seq_get_data(self._ctx, data, size, sequence) != size:
            raise EngineError("llama.cpp could not copy a sequence's cache")
        return data

    def restore(self, data: Any, sequence: int) -> None:
        """Put a copy `save` made into `sequence`'s (empty) cells."""
        if self._lib.llama_state_seq_set_data(self._ctx, data, len(data), sequence) == 0:
            raise EngineError("llama.cpp could not put a kept sequence's cache back")

    def decode(self, work: list[tuple[int, list[int], int, bool]]) -> list[np.ndarray]:
        """Run (sequence id, tokens, first position, logits for every token?) items as one batch; per item, its
        logits rows (every token's, or the last token's only) as float32 [rows, vocab].

        With a stream per sequence, llama.cpp computes in one pass (ubatch) only sequences whose ids follow each
        other in the batch, each the last one's plus one (its `split_equal` with `sequential`; 0, 2, 5 are three
        passes), and each pass reads every weight again: 16 rows shuffled took 107 ms a step here, in the order of
        their ids 48.5 ms. So the items go into the batch by sequence id, whatever order they are given in."""
        placed = sorted(range(len(work)), key=lambda item: work[item][0]) if not self.unified else None
        ordered = [work[item] for item in placed] if placed is not None else work
        batch, count = self._batch, 0
        for sequence, tokens, start, every in ordered:
            for offset, token in enumerate(tokens):
                batch.token[count] = token
                batch.pos[count] = start + offset
                batch.n_seq_id[count] = 1
                batch.seq_id[count][0] = sequence
                batch.logits[count] = int(every or offset == len(tokens) - 1)
                count += 1
        if count > self.cells:
            raise EngineError(f"llama.cpp: {count} tokens in one batch, the context holds {self.cells}")
        batch.n_tokens = count
        # every llama.cpp computation of the process runs on one thread: its CPU backend keeps a team of OpenMP
        # workers per calling thread, and once a second thread has computed (the server's worker after a warm-up
        # on the main thread, the benchmark's serving replay after its generate calls), each step of the other took
        # ~2.8x as long here (single stream: 10 ms per token → 28.6 ms)
        status = _COMPUTE.submit(self._lib.llama_decode, self._ctx, batch).result()
        if status != 0:
            raise RuntimeError(
                f"llama.cpp decode failed (status {status}: {'no room left in the KV cache' if status == 1 else 'error'})"
            )
        out = self._lib.llama_get_logits(self._ctx)
        rows = sum(len(tokens) if every else 1 for _, tokens, _, every in work)
        logits = np.ctypeslib.as_array(out, shape=(rows, self._vocab))
        results, first = [], 0
        for _, tokens, _, every in ordered:
            size = len(tokens) if every else 1
            results.append(np.array(logits[first : first + size], dtype=np.float32))
            first += size
        if placed is None:
            return results
        by_item = dict(zip(placed, results, strict=True))
        return [by_item[item] for item in range(len(work))]  # in the order the items came


class LlamaCppSequence:
    """One sequence (seq_id 0) of a context: several positions per `llama_decode` with every row's logits, and
    its cells from a position on removed on rewind (speculative decoding)."""

    def __init__(self, context: _Context) -> None:
        self._context, self.length = context, 0

    def extend(self, tokens: list[int], every: bool = True) -> np.ndarray:
        (logits,) = self._context.decode([(0, tokens, self.length, every)])
        self.length += len(tokens)
        return logits

    def kv_bytes(self) -> int:
        """Bytes of the sequence's state as llama.cpp saves it: its cells' keys and values (and a small header)."""
        context = self._context
        return int(context._lib.llama_state_seq_get_size(context._ctx, 0))

    def rewind(self, length: int) -> None:
        if length < self.length:
            self._context.truncate(0, length)
            self.length = length


def _room_for(tokens: int) -> int:
    """KV cells for `tokens`: the next power of two with room to grow (at least 512)."""
    return max(512, 1 << int(tokens + 64).bit_length())


def gguf_loss(path: Path, sequences: list[list[int]], threads: int) -> float:
    """Mean next-token loss per token of the GGUF file at `path` over `sequences` (how the mixed-precision search
    measures a plan in llama.cpp itself)."""
    model = GgufModel(path)
    context = _Context(model, _room_for(max(len(ids) for ids in sequences)), 1, threads)
    total, tokens = 0.0, 0
    try:
        for ids in sequences:
            context.clear()
            (logits,) = context.decode([(0, ids, 0, True)])
            nll, count = next_token_nll(logits, ids)
            total, tokens = total + nll, tokens + count
    finally:  # freed now, not when a traceback holding this frame goes (the search quantizes and loads many)
        del context, model
    return total / max(tokens, 1)

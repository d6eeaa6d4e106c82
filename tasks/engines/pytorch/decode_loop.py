"""llmopt's own greedy decode loop for the torch engine, the way gpt-fast and torchao's generate run one: what
`runtime.compile: true` means on a cuda target.

transformers' `generate` compiles the model's forward over a static cache but keeps its per-token host loop (logits
processors, stopping criteria, cache bookkeeping, a host sync per token): on an H200 that held a compiled 1 B Llama
at 10 % of the memory bandwidth. Here the host does nothing per token but queue the next step:

- a static KV cache per (batch bucket, length bucket), made once and reused: batch sizes are rounded up to a power
  of two (1, 2, 4, 8, 16, ...; the extra rows repeat the first prompt and are dropped) and lengths to a multiple of
  `LENGTH_STEP`, so a new batch size of a bucket already seen neither recompiles nor records a graph;
- the prompt runs eagerly (one forward, its length is free), then a host sync: the first token's time is read from
  the timed call itself (the time to first token needs no call of its own);
- every later token is one call of the compiled step: the model's forward for one token per row, the suppressed ids
  masked, the argmax, all on the device (with CUDA graphs: one replay). Its token goes into a device buffer of the
  call's tokens, which the next step reads; positions advance in place. Nothing comes back to the host until the
  end, except, when the call stops at end of sequence, one look every `STOP_CHECK_EVERY` tokens.

Buckets are kept while the device's memory holds them: a new bucket's cache evicts the least recently used ones
first (`CACHE_MEMORY_SHARE`), and after `MAX_COMPILED_BUCKETS` compiled graphs of the step in the process a new
bucket steps eagerly (same tokens, logged once) rather than hit dynamo's recompile limit.

The attention mask is made inside the step from the position (keys up to the current one), so the same graph serves
every position, and eager and compiled steps mask alike (transformers skips the mask of a one-token query when none
is given, which over a static cache would attend to its empty tail).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LENGTH_STEP = 256  # static caches hold a multiple of this many positions
# Graphs of one step's code compiled at most in a process (every loop's buckets, every server decoder's); later
# buckets step eagerly. Each is one more graph of the same code, and past dynamo's recompile limit (the runtime
# raises it to 64) a fullgraph compile raises mid-run instead: an evaluation of many prompt lengths (lm-eval's), or
# a server's decoder made again after each model swap, would fail half-way
MAX_COMPILED_BUCKETS = 32
_compiled_graphs: Counter[str] = Counter()  # per step's code: graphs handed to the compiler in this process
_counting = threading.Lock()


def may_compile(code: str) -> bool:
    """Whether one more graph of the step `code` names may be compiled in this process (it is then counted); the
    first refusal is logged."""
    with _counting:
        _compiled_graphs[code] += 1
        taken = _compiled_graphs[code]
    if taken == MAX_COMPILED_BUCKETS + 1:
        log.warning(
            f"{code}: {MAX_COMPILED_BUCKETS} graphs compiled in this process; new buckets step eagerly"
        )
    return taken <= MAX_COMPILED_BUCKETS


# A new bucket's cache may take this share of the device's free memory; least recently used buckets go first
# (a (16, 4096) cache of a 1 B Llama is ~10 GB, and buckets were kept for the runtime's life)
CACHE_MEMORY_SHARE = 0.8
# stopping at end of sequence: the host looks whether every row ended once per this many tokens
STOP_CHECK_EVERY = 16


def batch_bucket(rows: int) -> int:
    """The batch size a call of `rows` sequences runs at: the next power of two."""
    if rows < 1:
        raise ValueError("a decode call needs at least one sequence")
    return 1 << (rows - 1).bit_length()


def length_bucket(positions: int, context: int) -> int:
    """The static cache length for `positions` tokens: the next multiple of `LENGTH_STEP`, at most `context`."""
    if positions > context:
        raise ValueError(f"{positions} tokens do not fit the model's context of {context}")
    return min(-(-positions // LENGTH_STEP) * LENGTH_STEP, context)


def cuda_graph_compiler(step: Callable) -> Callable:
    """The compiler a cuda target uses: the whole step as one graph (no breaks), one fixed shape per bucket, replayed
    as a CUDA graph."""
    import torch

    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)


class DecodeLoop:
    """Greedy continuations of equal-length prompts with `model` on `device` (see the module's text). `compiler`
    turns the one-token step into what runs (None: eager, as the CPU tests may run it); `no_grad` is the runtime's
    inference context."""

    def __init__(self, model: Any, device: Any, compiler: Callable | None, no_grad: Any) -> None:
        self._model, self._device, self._no_grad = model, device, no_grad
        self._compiler = compiler
        # (batch, length) bucket -> its cache and step, least recently used first
        self._caches: OrderedDict[tuple[int, int], tuple[Any, Callable]] = OrderedDict()
        self.context = model.config.max_position_embeddings
        # seconds of each bucket's first step: compiling it (and recording its CUDA graph), reported apart
        self.compile_s: dict[tuple[int, int], float] = {}
        self._compiled: set[tuple[int, int]] = set()

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (batch, length) buckets made so far, each with its cache and its compiled step."""
        return sorted(self._caches)

    def generate(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        suppressed: frozenset[int] = frozenset(),
        stop: frozenset[int] = frozenset(),
        on_first: Callable[[], None] = lambda: None,
    ) -> list[list[int]]:
        """`max_new_tokens` greedy tokens for each of the equal-length prompts of `batch`, never one of `suppressed`;
        with `stop` (the end-of-sequence ids) each row ends after its first stop id, and the call once every row
        has (looked at every `STOP_CHECK_EVERY` tokens). `on_first` is called once the first tokens are chosen."""
        rows, length = len(batch), len(batch[0])
        if any(len(prompt) != length for prompt in batch):
            raise ValueError("the decode loop takes prompts of one length")
        if max_new_tokens < 1:
            raise ValueError("the decode loop makes at least one token")
        # the last token is never fed back: length + max_new_tokens - 1 positions
        bucket = (batch_bucket(rows), length_bucket(length + max_new_tokens - 1, self.context))
        cache, step = self._bucket(bucket)
        padded = batch + [batch[0]] * (bucket[0] - rows)
        # everything under the runtime's inference context: the cache's tensors were made in it (inference tensors
        # under torch.inference_mode), and an in-place update of one outside it fails (its reset, at the second call)
        with self._no_grad():
            cache.reset()
            tokens = self._decode(cache, step, bucket, padded, max_new_tokens, suppressed, stop, on_first)
        return [_cut_after(row, stop) for row in tokens[:rows]]

    def _decode(
        self,
        cache: Any,
        step: Callable,
        bucket: tuple[int, int],
        padded: list[list[int]],
        max_new_tokens: int,
        suppressed: frozenset[int],
        stop: frozenset[int],
        on_first: Callable[[], None],
    ) -> list[list[int]]:
        import torch

        rows, length = len(padded), len(padded[0])
        vocabulary = self._model.config.vocab_size
        bias = torch.zeros(vocabulary, dtype=torch.float32, device=self._device)
        barred = sorted(token for token in suppressed if 0 <= token < vocabulary)  # an id past the vocabulary
        if barred:  # would be a device-side assert on a GPU
            bias[barred] = float("-inf")
        stops = torch.tensor(sorted(stop), dtype=torch.long, device=self._device) if stop else None
        # one row per token of the call ([tokens, rows]): each step reads a contiguous row, whatever the length
        tokens = torch.empty(max_new_tokens, rows, dtype=torch.long, device=self._device)
        positions = torch.arange(length, device=self._device)
        logits = self._model(
            input_ids=torch.tensor(padded, device=self._device),
            cache_position=positions,
            attention_mask=_mask_up_to(positions[-1:], bucket),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        tokens[0] = (logits[:, -1].float() + bias).argmax(-1)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        on_first()
        position, produced = positions[-1:] + 1, 1
        for index in range(1, max_new_tokens):
            if stops is not None and index % STOP_CHECK_EVERY == 0 and _all_stopped(tokens[:index], stops):
                break
            if self._device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were copied out
            # a bucket's first two steps compile, then record the CUDA graph (cudagraph trees record at the second)
            first = index <= 2 and bucket not in self._compiled and synced_clock(self._device)
            tokens[index] = step(tokens[index - 1].unsqueeze(1), position, bias)[:, 0]
            if first:
                self.compile_s[bucket] = self.compile_s.get(bucket, 0.0) + synced_clock(self._device) - first
            position.add_(1)
            produced = index + 1
        if self.compile_s.get(bucket) is not None:
            self._compiled.add(bucket)
        return tokens[:produced].T.tolist()

    def _bucket(self, bucket: tuple[int, int]) -> tuple[Any, Callable]:
        if bucket not in self._caches:
            from transformers import StaticCache

            self._evict_for(bucket)
            cache = StaticCache(config=self._model.config, max_cache_len=bucket[1])
            step = _one_token_step(self._model, cache, bucket)
            if self._compiler is not None and may_compile("decode loop"):
                step = self._compiler(step)
            self._caches[bucket] = (cache, step)
        self._caches.move_to_end(bucket)
        return self._caches[bucket]

    def _evict_for(self, bucket: tuple[int, int]) -> None:
        """Least recently used buckets dropped until `bucket`'s cache fits the device's free memory's share."""
        need = cache_bytes(self._model, bucket)
        while self._caches and need > CACHE_MEMORY_SHARE * device_free_bytes(self._device):
            evicted, _ = self._caches.popitem(last=False)
            self._compiled.discard(evicted)


def cache_bytes(model: Any, bucket: tuple[int, int]) -> int:
    """Bytes of a static KV cache of `bucket` (rows, positions) for `model`: keys and values of every layer."""
    config = model.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = model.get_input_embeddings().weight.element_size()
    return 2 * config.num_hidden_layers * bucket[0] * heads * bucket[1] * head * size


def device_free_bytes(device: Any) -> int:
    """Memory a new tensor on `device` can take: a GPU's free memory plus what torch's allocator holds unused; the
    process's free memory on the CPU."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    from tasks.engines.contract import free_memory

    return free_memory()


def _mask_up_to(position: Any, bucket: tuple[int, int]) -> Any:
    """The 2-D attention mask over a static cache of the bucket's length: every key up to `position` (a 1-element
    tensor), for every row."""
    import torch

    keys = torch.arange(bucket[1], device=position.device)
    return (keys <= position).to(torch.long).expand(bucket[0], bucket[1])


def _one_token_step(model: Any, cache: Any, bucket: tuple[int, int]) -> Callable:
    """The step a bucket compiles: one token per row at `position` -> each row's greedy next token ([rows, 1])."""

    def step(token: Any, position: Any, bias: Any) -> Any:
        logits = model(
            input_ids=token,
            cache_position=position,
            attention_mask=_mask_up_to(position, bucket),
            past_key_values=cache,
            use_cache=True,
        ).logits
        return (logits[:, -1].float() + bias).argmax(-1, keepdim=True)

    return step


def synced_clock(device: Any) -> float:
    """The clock once the device's queued work is done."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _all_stopped(tokens: Any, stops: Any) -> bool:
    """Whether every row (a column of `tokens`) holds one of `stops` (one host sync)."""
    import torch

    return bool(torch.isin(tokens, stops).any(0).all())


def _cut_after(row: list[int], stop: frozenset[int]) -> list[int]:
    """`row` up to and including its first stop id."""
    return next((row[: i + 1] for i, token in enumerate(row) if token in stop), row)

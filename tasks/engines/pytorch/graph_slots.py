"""The torch engine's batch decoder on a GPU with `runtime.compile: true`: the slot decoder's rows
(tasks/engines/pytorch/slots.py) with the running rows' step compiled whole and replayed as a CUDA graph, the
server's side of llmopt's decode loop (tasks/engines/pytorch/decode_loop.py). The padded eager batch a GPU gets
otherwise copies every cache each step and launches every kernel from the host: the launch-bound regime the first
H200 check measured at 1-3 % of the memory bandwidth.

- A step of n running rows runs at the next power of two of rows (1, 2, 4, 8, 16, ...: `batch_bucket`), the running
  rows being the buffers' first ones already. The extra rows carry token 0 written at their own row's spare
  position, the buffers' last, which no sequence ever reaches (the buffers keep one position past every
  sequence's), rotated as position 0 (a rotary embedding that rescales with the longest position would otherwise
  rotate the real rows differently); their logits are dropped. So a bucket's graph serves every count of rows in
  it.
- Attention reads each row's first `span` positions, span the next power of two of the longest row (at least
  `SPAN_STEP`), each row masked to its own length: one graph per (rows bucket, span), none per position.
- The step is tensor work only: the slot decoder's own layers pass (`_through_layers`), nothing read back but the
  logits, which the server samples from.
- Prompt slices (`step_with_prefills`, under the server's token budget) run eagerly right after the compiled step:
  their lengths vary per call, and a prompt's large matrix products do not wait on kernel launches.
- `reserve` (the server's start, before the first request) makes the buffers for `serve.max_batch` rows of
  `GRAPH_POSITIONS` positions, marked as static addresses (the graphs read and write them in place), and compiles
  every rows bucket up to `max_batch` at the shortest span, so clients do not wait on compiles; a longer span
  compiles when a row first needs it, and a sequence longer than the buffers grows them (the next steps compile
  again).

A bucket's first step compiles and, with CUDA graphs, its second records: both timed as `compile_s` per (rows, span).
Every decoder made in a process (a server makes one per model version, and again after a failed step) compiles the
same code again: past the process's budget (decode_loop.py `may_compile`) new buckets step eagerly, where dynamo's
recompile limit would stop the server's steps with an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.engines.pytorch.decode_loop import (
    MAX_COMPILED_BUCKETS,
    batch_bucket,
    cache_bytes,
    device_free_bytes,
    may_compile,
    synced_clock,
)
from tasks.engines.pytorch.slots import SlotBatchDecoder, running_mask

SPAN_STEP = 256  # the shortest span a compiled step attends over
GRAPH_POSITIONS = 2048  # positions per row reserved before the first request (the model's context at most)


def graphs_in_slots(model: Any, sdpa_backend: str | None) -> bool:
    """Whether the compiled slot step serves `model` (a Llama-shaped one `steps_in_slots` takes): not with SDPA
    pinned to a kernel that takes no grouped-query attention with a mask (efficient, cuDNN; flash takes no mask),
    nor with a rotary embedding that rescales with the longest position it sees (dynamic, longrope: a branch on
    the data, which one graph cannot hold)."""
    rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    return sdpa_backend in (None, "math") and rope not in ("dynamic", "longrope")


def span_bucket(positions: int, capacity: int) -> int:
    """The span a step whose longest row holds `positions` positions attends over: the next power of two of at
    least `SPAN_STEP`, at most the buffers' `capacity`."""
    return min(max(SPAN_STEP, batch_bucket(max(positions, 1))), capacity)


class GraphSlotDecoder(SlotBatchDecoder):
    """Slot rows with the running rows' step compiled per (rows bucket, span) by `compiler` (see the module
    docstring; None: the same padded step run eagerly, as CPU tests run it)."""

    def __init__(self, model: Any, no_grad: Any, device: Any, compiler: Callable | None) -> None:
        super().__init__(model, no_grad, device)
        if compiler is not None:
            import torch._dynamo.config as dynamo

            # every bucket, and every decoder's, is one more graph of `_decode_step`: room for the process's
            # budget (`may_compile`) under dynamo's limit, past which a fullgraph compile raises
            dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * MAX_COMPILED_BUCKETS)
        self._step = compiler(self._decode_step) if compiler is not None else None  # None: eager
        self._eager: set[tuple[int, int]] = set()  # buckets past the process's compile budget (`may_compile`)
        self.compile_s: dict[tuple[int, int], float] = {}  # per (rows, span): its first two steps
        self._runs: dict[tuple[int, int], int] = {}  # steps run per (rows, span)

    def reserve(self, rows: int) -> None:
        """Buffers for `rows` sequences of `GRAPH_POSITIONS` positions (fewer where half the device's free memory
        would not hold them), and every rows bucket up to theirs compiled (and recorded) at the shortest span: at
        the server's start, not in its first clients' steps."""
        if self._ids:
            return
        rows = batch_bucket(rows)
        positions = min(GRAPH_POSITIONS, self._model.config.max_position_embeddings)
        free = device_free_bytes(self._device)
        while positions > SPAN_STEP and 2 * cache_bytes(self._model, (rows, positions)) > free:
            positions //= 2
        self._room(rows, positions)
        with self._no_grad():
            for bucket in (1 << power for power in range(rows.bit_length())):
                for _ in range(2):
                    self._decode([], bucket)

    def _room(self, rows: int, positions: int) -> None:
        """The slot decoder's buffers, rows a power of two (a bucket's) and positions a power of two of at least
        `SPAN_STEP` with one spare past them (the padded rows write there), marked static for CUDA graphs when
        they are new; new buffers are new graph inputs, so their buckets count as new (compiled again)."""
        import torch

        held = self._keys[0] if self._keys else None
        with torch.inference_mode(
            False
        ):  # (a step may grow them: never as inference tensors, which rows copy)
            super()._room(batch_bucket(rows), span_bucket(positions, 1 << 62) + 1)
        if self._keys[0] is not held:
            self._runs.clear()
            self._eager.clear()
            if self._device.type == "cuda":
                for buffer in (*self._keys, *self._values):
                    torch._dynamo.mark_static_address(buffer)

    def _forward(self, decoding: list[int], segments: list[tuple[int, list[int]]]) -> Any:
        import torch

        parts = []
        if decoding:
            parts.append(self._decode(decoding))
        if segments:
            parts.append(super()._forward([], segments))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(self, decoding: list[int], rows: int = 0) -> Any:
        """The first `len(decoding)` rows' next-token logits, through the compiled step of their bucket (or of
        `rows`, if more: all rows padded, as `reserve` warms buckets)."""
        import torch

        count = len(decoding)
        rows = max(rows, batch_bucket(count) if count else 1)
        self._room(rows, 0)
        capacity = self._keys[0].shape[2]
        spare = capacity - 1
        span = span_bucket(int(self._lengths[:count].max()) + 1 if count else 1, capacity)
        ids = torch.tensor([*decoding, *[0] * (rows - count)], device=self._device)
        position = torch.tensor(
            [*self._lengths[:count].tolist(), *[spare] * (rows - count)], device=self._device
        )
        bucket, runs = (rows, span), self._runs.get((rows, span), 0)
        if runs == 0 and self._step is not None and not may_compile("server decoder"):
            self._eager.add(bucket)
        step = self._decode_step if self._step is None or bucket in self._eager else self._step
        start = synced_clock(self._device) if runs < 2 else None
        if self._device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits were copied out
        logits = step(ids, position, span)[:count]
        if start is not None:  # a bucket's first two steps: the compile, then the CUDA graph's recording
            self.compile_s[bucket] = self.compile_s.get(bucket, 0.0) + synced_clock(self._device) - start
        self._runs[bucket] = runs + 1
        return logits

    def _decode_step(self, ids: Any, position: Any, span: int) -> Any:
        """What a bucket compiles: one token per row at its position -> float32 logits [rows, vocabulary]."""
        import torch

        model = self._model.model
        hidden = model.embed_tokens(ids)
        # the padded rows (at the spare position) are rotated as position 0: a rotary embedding that rescales with
        # the longest position it is given would otherwise rotate the real rows by another scale
        spare = self._keys[0].shape[2] - 1
        cos, sin = model.rotary_emb(hidden[None], position.masked_fill(position == spare, 0)[None])
        rows = ids.shape[0]
        mask = running_mask(position, span, hidden.dtype)
        row_index = torch.arange(rows, device=ids.device)
        hidden = self._through_layers(hidden, cos, sin, row_index, position, rows, span, mask, [])
        return self._head(model.norm(hidden)).float()

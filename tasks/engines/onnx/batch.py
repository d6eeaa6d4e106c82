"""The ONNX engine's batch decoder for the server: the builder's graph run by plain ONNX Runtime, rows joining and
leaving between steps, prompts in slices (see `OrtBatchDecoder`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tasks.engines.contract import (
    BatchDecoder,
    RetainedPrefixes,
    free_memory,
    retain_budget,
    shared_start,
    touch,
    zeroed,
)
from tasks.engines.onnx.bf16_prompts import BfloatPrompts, faster_in_bf16, weights_bytes
from tasks.engines.onnx.errors import engine_says
from tasks.engines.onnx.float_prompts import (
    FLOAT_PROMPT_TOKENS,
    measured_float_from,
    return_freed_memory,
    rounds_activations_to_int8,
)
from tasks.errors import ArtifactUnreadable

# Prompt slices run in bfloat16 by torch where the decoder has that path (tasks/engines/onnx/bf16_prompts.py) when
# the step's slices of `BF16_SLICE_TOKENS` or more hold `BF16_PROMPT_TOKENS` or more between them (the step's other
# slices then join that call); otherwise on the graph. Through the server's scheduler (SmolLM2-135M int4 mixed,
# Xeon with AMX, 2 threads), a lone slice took per token 1.1 ms in bfloat16 against 1.55 on the graph at 128-400
# tokens, about as long at 64-128 and ~1.3x as long at 32-64 (the bfloat16 weights are twice the graph's bytes,
# which bound a call of few tokens); several slices in one call share that cost.
BF16_SLICE_TOKENS = 16
BF16_PROMPT_TOKENS = 96


class OrtBatchDecoder(BatchDecoder):
    """Iteration-level batching on the builder's graph, run by plain ONNX Runtime (ONNX Runtime GenAI's own
    generator takes no new sequences mid-flight and, on CPU, batches only prompts of one length).

    Each sequence's KV cache sits at the start of its row in one buffer per cache input, which the graph reads and
    writes in place (past and present bound to the same memory, as ONNX Runtime GenAI does): a step copies no
    cache. The attention mask gives every row its own length, and the graph's GroupQueryAttention derives each
    row's positions and where its new key goes from that mask, so a row computes exactly what it computes alone.
    A joining sequence's cache is written into the next free row and a leaving one's row is taken by the last row,
    so the rows in use stay the buffer's first ones and the others are not copied; the buffer is reallocated only
    when it must grow (twice the rows, or more positions). Until then it keeps its size after requests end.

    Prefix reuse: a newcomer whose prompt starts like a running sequence's tokens gets a copy of that row's keys
    and values for the shared positions and runs only the rest of its prompt (the same tokens at the same
    positions). With `retain_tokens`, a leaving row's keys and values are kept (a copy, least recently used out
    first) and serve later newcomers the same way; so do prompts still joining, as far as they are computed (a
    burst's prompts that start alike compute that start once: each slice looks again just before its call).
    Prompts join in slices (`stream_step`): the graph takes one new-token count per call, so a joining prompt's
    slice cannot share the running rows' call as in llama.cpp; the step runs first and its tokens go out, then each
    slice gets its own call, shortest first, its first token going out as soon as it is done.

    Long slices with float activations: where the graph's MatMulNBits round activations to int8 (the builder's
    `accuracy_level: 4`), a slice of `float_from` tokens or more runs on a second session of the graph that keeps
    them in float32 (`mlas.qnbit.force_fp32`), on CPUs where MLAS's float kernels are the faster ones over many rows
    (`choose_float_from` measures from which length, once per runtime: tasks/engines/onnx/float_prompts.py). It is
    the more exact path (activations not rounded), so a served prompt is computed at least as accurately as the
    evaluation measured it. Its own packed copy of the weights is made only where there is room for it twice over.

    Long slices in bfloat16: on a CPU with fast bfloat16 matrix products (AMX), the same weights dequantized to
    bfloat16 run prompts ~1.5-2x faster through torch than ONNX Runtime's float kernels, several prompts' slices in
    one call (tasks/engines/onnx/bf16_prompts.py); their keys and values join the graph's cache and the steps stay
    on the graph. `choose_bf16` decides once per runtime by measuring both on this machine. It takes every slice of a
    step whose long slices hold `BF16_PROMPT_TOKENS` between them; a lone slice shorter than that still runs on
    the float session (from `float_from`) or the graph."""

    chunked_prefill = True  # each prompt slice runs in its own call right after a step (see above)

    def __init__(
        self,
        model_path: Path,
        kv_shape: tuple[int, int],
        threads: int,
        bf16: BfloatPrompts | None = None,
        float_from: int | None = FLOAT_PROMPT_TOKENS,
    ) -> None:
        """`float_from`: the shortest prompt slice run with float activations (see above); None: none is."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # the graph's weights stay in their file beside it (the graph itself is handed over as bytes)
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(model_path.parent)
        )
        self._ort = ort
        try:
            import onnx

            model = onnx.load(model_path, load_external_data=False)  # the graph alone, once
            int8_activations = rounds_activations_to_int8(model)
            graph = last_position_logits(model)
            self._session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        except (
            Exception
        ) as exc:  # a protobuf DecodeError, ONNX Runtime's Fail/InvalidProtobuf, a missing file
            said = engine_says(exc)
            raise ArtifactUnreadable(f"{model_path}: ONNX Runtime cannot load this model: {said}") from exc
        self._prompt_session = self._session  # what runs a slice of `_float_from` tokens or more
        self._present = [output.name for output in self._session.get_outputs()[1:]]
        self._past = [name.replace("present", "past_key_values") for name in self._present]
        inputs = {item.name: item for item in self._session.get_inputs()}
        self._kv_dtype = np.float16 if inputs[self._past[0]].type == "tensor(float16)" else np.float32
        self._kv_shape = kv_shape
        self._model_path, self._int8_activations = model_path, int8_activations
        self._threads = threads
        self._bf16 = bf16  # long slices of a step in bfloat16 by torch (`choose_bf16`); a lone one on the float session
        self._float_from: int | None = None  # (where there is a float session)
        if int8_activations and float_from is not None and free_memory() > 2 * weights_bytes(model_path):
            self._float_from = float_from
            options.add_session_config_entry("mlas.qnbit.force_fp32", "1")
            # its own thread pool: idle between its calls (long ones) instead of spinning beside the steps' pool
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._prompt_session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        self._ids: list[int] = []  # sequence id of each row, in row order
        self._lengths = np.zeros(0, dtype=np.int64)  # tokens in each row's cache
        self._store: list[np.ndarray] = []  # per cache input: [slots, kv_heads, capacity, head_size]
        self._cache: list[np.ndarray] = []  # per cache input: the rows in use, views of `_store`
        self._binding: Any = None
        self._next_id = 0
        self._tokens: list[list[int]] = []  # what each row's cache holds, position by position
        self._partial: dict[int, tuple[list[int], list[np.ndarray]]] = {}  # opened: (tokens in, their K/V)
        # finished sequences kept for prefix reuse: per cache input a copy of its K/V [kv_heads, tokens, head_size]
        self._retained = RetainedPrefixes()
        self.reused_tokens = 0  # prompt tokens copied from another row's cache instead of computed

    @property
    def active(self) -> int:
        return len(self._ids) + len(self._partial)

    @property
    def float_session(self) -> bool:
        """Whether prompt slices can run with float activations (a second session, see above)."""
        return self._float_from is not None

    def choose_float_from(self, context: int) -> int | None:
        """From which length prompt slices run with float activations, measured here on slices of at most
        `context` tokens (`measured_float_from`); None, and the float session dropped, where they do not pay on this
        CPU, there is no such session or the probe failed (logged: the graph runs every prompt, as it can)."""
        if self._float_from is not None:
            empty, vocabulary = self._empty_cache(), self._session.get_outputs()[0].shape[-1]
            self._float_from = measured_float_from(
                lambda tokens, long: self._run_alone(tokens, empty, long),
                self._model_path.parent.name,
                vocabulary,
                context,
            )
            if self._float_from is None:
                self._prompt_session = self._session  # its copy of the weights goes with it
                return_freed_memory()
        return self._float_from

    def choose_bf16(self) -> BfloatPrompts | None:
        """Run long prompt slices in bfloat16 from now on where the graph computes with int8 activations (so
        bfloat16 ones lose nothing against what the evaluation measured), its float32 cache is one the path
        extends, and `faster_in_bf16` finds the path agrees with this decoder's own prompt call and beats it here.
        The path chosen, or None."""
        if self._bf16 is None and self._int8_activations and self._kv_dtype == np.float32:
            self._bf16 = faster_in_bf16(  # against what a slice of the probe's length runs on now
                self._model_path, self._past, self._kv_shape, self._threads, self._run_chosen
            )
        return self._bf16

    def reserve(self, rows: int) -> None:
        if self._ids:  # (rows in use would be copied: only before the first)
            return
        self._reserve(rows, max(self._capacity, RESERVED_POSITIONS))
        touch(self._store)

    def open(self, prompt: list[int] | None = None) -> tuple[int, int]:
        """A new sequence fed by `step_with_prefills`; with `prompt`, holding already the longest start of it a
        row, a prompt still filling or a retained sequence holds (at most all but its last token). (its id, how
        many of the prompt's tokens it holds)."""
        tokens, cache = self._shared_start(prompt or [])
        self._next_id += 1
        self._partial[self._next_id] = (tokens, cache)
        return self._next_id, len(tokens)

    def add(self, prompt: list[int]) -> tuple[int, Any]:
        sequence, held = self.open(prompt)
        try:
            logits = next(self._extend_parts([(sequence, prompt[held:])]))[sequence]
        except Exception:
            self.remove(sequence)
            raise
        self._join(sequence)
        return sequence, logits

    def step_with_prefills(
        self, tokens: dict[int, int], fills: list[tuple[int, list[int], bool]]
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        stepped: dict[int, Any] = {}
        filled: dict[int, Any] = {}
        for rows, done in self.stream_step(tokens, fills):
            stepped |= rows
            filled |= done
        return stepped, filled

    def stream_step(
        self, tokens: dict[int, int], fills: list[tuple[int, list[int], bool]]
    ) -> Iterator[tuple[dict[int, Any], dict[int, Any]]]:
        """The running rows' step first (its tokens go out before any prompt call), then the slices: the bfloat16
        call where it takes them, else each alone, shortest first (a short prompt's first token does not wait for
        the long ones' calls). A slice whose prompt starts like one computed earlier in the step (or before) runs
        from where they part (see `_extend`)."""
        for sequence, chunk, _ in fills:
            if sequence not in self._partial or not chunk:
                raise ValueError(
                    f"sequence {sequence} is not an opened one still filling, or its chunk is empty"
                )
        if self._ids:
            yield self.step(tokens), {}
        last = {sequence: flag for sequence, _, flag in fills}
        for found in self._extend_parts([(sequence, chunk) for sequence, chunk, _ in fills]):
            for sequence in found:
                if last[sequence]:  # its prompt is complete: it steps with the others from the next call on
                    self._join(sequence)
            yield {}, found

    def _shared_start(
        self, prompt: list[int], opened: int | None = None, beyond: int = 0
    ) -> tuple[list[int], list[np.ndarray]]:
        """The longest start of `prompt` (all but its last token at most) a row, a prompt still filling (other than
        `opened`'s) or a retained finished sequence holds, with a copy of its K/V; nothing unless it is longer than
        `beyond` tokens."""
        partial = [(key, held) for key, (held, _) in self._partial.items() if key != opened]
        shared, source, kept = (
            shared_start(prompt, [*self._tokens, *(held for _, held in partial)], self._retained)
            if self.reuse_prefixes
            else (0, None, None)
        )
        if shared <= beyond or (source is None and kept is None):
            return [], self._empty_cache()
        self.reused_tokens += shared
        if kept is not None:
            cache = [np.ascontiguousarray(kv[None, :, :shared]) for kv in self._retained.use(kept)]
        elif source >= len(self._tokens):  # a prompt still filling: its cache so far, one array per input
            held_cache = self._partial[partial[source - len(self._tokens)][0]][1]
            cache = [np.ascontiguousarray(kv[:, :, :shared]) for kv in held_cache]
        else:
            # a copy, always: a view of a whole row would change when `remove` moves another row into it
            cache = [kv[source : source + 1, :, :shared].copy() for kv in self._cache]
        return list(prompt[:shared]), cache

    def _empty_cache(self) -> list[np.ndarray]:
        """A sequence's cache before its first token, per cache input."""
        empty = np.zeros((1, *self._kv_shape[:1], 0, self._kv_shape[1]), self._kv_dtype)
        return [empty for _ in self._past]

    def _retain(self, row: int) -> None:
        """Keep a copy of a leaving row's keys and values for later prompts that start like it; the least
        recently used go first beyond `retain_tokens` or a quarter of the free memory (`retain_budget`; one that
        starts another kept one replaces it)."""
        tokens, held = self._tokens[row], int(self._lengths[row])
        if not self.reuse_prefixes or self.retain_tokens <= 0:
            return
        budget = retain_budget(self.retain_tokens, sum(store[0, :, :1].nbytes for store in self._store))
        self._retained.fit(budget)  # free memory may have shrunk since the last ones were kept
        if not 1 < held <= budget:
            return
        self._next_id += 1
        copies = [store[row, :, :held].copy() for store in self._store]
        self._retained.keep(self._next_id, tokens[:held], copies, budget)

    def _extend(self, sequence: int, chunk: list[int]) -> Any:
        """Run `chunk` after what the opened `sequence` holds, in its own call of the graph (on the float session
        from `_float_from` tokens on, where there is one); the logits after its last token. Where another
        sequence computed since it opened (a prompt of the same burst, say) holds more of its start than it does,
        it takes that start's keys and values and computes only the rest."""
        held, cache = self._partial[sequence]
        whole = held + list(chunk)
        start, copied = self._shared_start(whole, opened=sequence, beyond=len(held))
        if start:
            self.reused_tokens -= len(held)  # (counted when it opened)
            cache, chunk = copied, whole[len(start) :]
        self.steps += 1
        logits, present = self._run_chosen(chunk, cache)
        self._partial[sequence] = (whole, present)
        return logits

    def _extend_parts(self, fills: list[tuple[int, list[int]]]) -> Iterator[dict[int, Any]]:
        """Run each (opened sequence, chunk) after what it holds, handing out the logits after each chunk's last
        token per call: all of them in one bfloat16 call where the decoder has that path and the slices of
        `BF16_SLICE_TOKENS` or more hold `BF16_PROMPT_TOKENS` between them, else each in its own call of the
        graph, shortest first."""
        wide = sum(len(chunk) for _, chunk in fills if len(chunk) >= BF16_SLICE_TOKENS)
        if self._bf16 is not None and wide >= BF16_PROMPT_TOKENS:
            # the step's other slices ride along: a few more rows of the same matmuls cost next to nothing there,
            # where each took a graph call of its own (~10 ms for the last token of a prompt whose start was reused)
            self.steps += 1
            slices = [(self._partial[sequence][1], chunk) for sequence, chunk in fills]
            found = {}
            for (sequence, chunk), (logits, present) in zip(fills, self._bf16.run(slices), strict=True):
                self._partial[sequence] = (self._partial[sequence][0] + list(chunk), present)
                found[sequence] = logits
            yield found
            return
        for sequence, chunk in sorted(fills, key=lambda fill: len(fill[1])):
            yield {sequence: self._extend(sequence, chunk)}

    def _run_chosen(self, chunk: list[int], cache: list[np.ndarray]) -> tuple[Any, list[Any]]:
        """`_run_alone` on the session a slice of this length runs on: with float activations from `_float_from`
        tokens on, where there is such a session."""
        return self._run_alone(chunk, cache, self._float_from is not None and len(chunk) >= self._float_from)

    def _run_alone(
        self, chunk: list[int], cache: list[np.ndarray], long: bool = True
    ) -> tuple[Any, list[Any]]:
        """One sequence's `chunk` after its `cache` (per cache input) in one call of the graph, on the float
        session if `long` and there is one: (the logits after its last token, the cache with the chunk's)."""
        ids = np.asarray([chunk], dtype=np.int64)
        mask = np.ones((1, int(cache[0].shape[2]) + len(chunk)), dtype=np.int64)
        session = self._prompt_session if long else self._session
        logits, *present = session.run(
            None, {"input_ids": ids, "attention_mask": mask, **dict(zip(self._past, cache, strict=True))}
        )
        return logits[0, -1].astype(np.float32), present

    def _join(self, sequence: int) -> None:
        """The opened `sequence`, its prompt complete, becomes the next row of the stepped buffer (rows already
        there are not copied, unless the buffer must grow)."""
        tokens, present = self._partial.pop(sequence)
        row = len(self._ids)
        self._reserve(row + 1, max(self._capacity, _room_for(len(tokens))))
        for store, kv in zip(self._store, present, strict=True):
            store[row, :, : len(tokens)] = kv[0]
        self._ids.append(sequence)
        self._tokens.append(tokens)
        self._lengths = np.append(self._lengths, len(tokens))
        self._bind()

    def _reserve(self, rows: int, capacity: int) -> None:
        """Room for `rows` rows of `capacity` positions: a larger buffer (twice the rows) with the rows in use
        copied in, where the one there is too small."""
        if self._store and rows <= self._store[0].shape[0] and capacity <= self._capacity:
            return
        have = self._store[0].shape[0] if self._store else 0
        slots = have if rows <= have else max(rows, 2 * have, 4)  # more positions alone: the same rows
        used = len(self._ids)
        grown = []
        for index in range(len(self._past)):
            buffer = zeroed((slots, self._kv_shape[0], capacity, self._kv_shape[1]), self._kv_dtype)
            if self._store:
                old = self._store[index]
                buffer[:used, :, : old.shape[2]] = old[:used]
            grown.append(buffer)
        self._store = grown

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        if set(tokens) != set(self._ids):
            raise ValueError(
                f"step needs a token for every active sequence {self._ids}, got {sorted(tokens)}"
            )
        if int(self._lengths.max()) + 1 > self._capacity:
            self._reserve(len(self._ids), _room_for(self._capacity + 1))
            self._bind()
        self.steps += 1
        width = int(self._lengths.max()) + 1
        mask = (np.arange(width)[None, :] <= self._lengths[:, None]).astype(np.int64)
        self._binding.bind_cpu_input(
            "input_ids", np.asarray([[tokens[s]] for s in self._ids], dtype=np.int64)
        )
        self._binding.bind_cpu_input("attention_mask", mask)
        self._session.run_with_iobinding(self._binding)
        logits = self._binding.get_outputs()[0].numpy()[:, -1].astype(np.float32)
        self._lengths = self._lengths + 1
        for row, sequence in enumerate(self._ids):
            self._tokens[row].append(tokens[sequence])
        return dict(zip(self._ids, logits, strict=True))

    def remove(self, sequence: int) -> None:
        """Forget `sequence`: the last row moves into its place (one row's cache copied), so the rows in use stay
        the buffer's first ones and the graph runs no empty row."""
        if self._partial.pop(sequence, None) is not None:
            return
        row, last = self._ids.index(sequence), len(self._ids) - 1
        self._retain(row)
        if row != last:
            held = int(self._lengths[last])
            for store in self._store:
                store[row, :, :held] = store[last, :, :held]
            self._ids[row], self._tokens[row] = self._ids[last], self._tokens[last]
            self._lengths[row] = held
        del self._ids[last], self._tokens[last]
        self._lengths = self._lengths[:last]
        self._bind()

    @property
    def _capacity(self) -> int:
        return self._store[0].shape[2] if self._store else 0

    def _bind(self) -> None:
        """Make the rows in use of the buffers what the graph reads its past from and writes its present into."""
        rows = len(self._ids)
        self._cache = [store[:rows] for store in self._store] if rows else []  # views: no copy
        self._binding = None
        if not rows:
            return
        binding = self._session.io_binding()
        binding.bind_output("logits")
        for past, present, buffer in zip(self._past, self._present, self._cache, strict=True):
            value = self._ort.OrtValue.ortvalue_from_numpy(buffer)  # shares the numpy buffer's memory
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self._binding = binding


def last_position_logits(model: Any) -> bytes:
    """The builder's graph with its lm_head applied to each row's last position only: the server needs no other
    position's logits, and over a prompt the lm_head (the vocabulary times the hidden size, per position) was ~17 %
    of the call (SmolLM2-135M, 100 tokens). The same logits for that position (the rows are sliced before the
    lm_head, nothing else changes). `model`: the builder's ModelProto, without its weights (changed in place)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    head = next(node for node in graph.node if "logits" in node.output)
    if head.op_type not in ("MatMul", "MatMulNBits"):  # another head (a soft-capped one, say): left whole
        return model.SerializeToString()
    bounds = {"llmopt_last_start": -1, "llmopt_last_end": np.iinfo(np.int64).max, "llmopt_last_axis": 1}
    graph.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), k) for k, v in bounds.items())
    sliced = helper.make_node(
        "Slice", [head.input[0], *bounds], ["llmopt_last_hidden"], name="llmopt_last_position"
    )
    graph.node.insert(list(graph.node).index(head), sliced)
    head.input[0] = "llmopt_last_hidden"
    return model.SerializeToString()


# Positions per row set up before the first request (`reserve`): a prompt of a few hundred tokens and its answer.
# Memory that is not touched costs nothing (the buffers are zero pages until written).
RESERVED_POSITIONS = 512


def _room_for(tokens: int) -> int:
    """Buffer positions for a cache of `tokens`: the next power of two with room to grow (at least 256)."""
    return max(256, 1 << int(tokens + 64).bit_length())

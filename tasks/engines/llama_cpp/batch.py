"""The llama.cpp engine's server decoder: every running sequence in one `llama_decode` per step, each in a KV
stream of its own (tasks/engines/llama_cpp/runtime.py makes the contexts)."""

from __future__ import annotations

from typing import Any

from tasks.config_serving import LLAMA_STREAM_TOKENS as STREAM_TOKENS  # a row's cells by default
from tasks.engines.contract import BatchDecoder, RetainedPrefixes, retain_budget, shared_start


class LlamaCppBatchDecoder(BatchDecoder):
    """Iteration-level batching in llama.cpp: every step is one `llama_decode` with one token per sequence, each
    at its own position under its own `seq_id`, in a KV stream of its own (as llama-server's slots): a token attends
    over its own sequence's cells only. In one unified cache every token's attention spans the cells of every
    sequence (masked), so 16 rows of ~300 tokens stepped ~1.6x slower there, ~1.9x with finished ones kept too
    (docs/results/2026-12-06-serving-burst.md). Each sequence holds `sequence_tokens` (prompt + answer) at most.

    Prefix reuse: a newcomer whose prompt starts like a sequence in the cache is given that sequence's cells for
    the shared positions and runs only the rest of its prompt; the same tokens at the same positions have the same
    keys and values, so the answer does not change. With `retain_tokens`, a leaving sequence's cells are copied
    into this process's memory (only the cells it used) and its stream freed, as llama-server's prompt cache does:
    a newcomer continuing one gets the copy put back into its stream; one sharing a start with a running sequence
    gets a copy of that stream. Kept copies take at most `retain_tokens` and a quarter of the free memory, the
    least recently used going first. The context (a stream per row, `rows`) is made on first use or `reserve`."""

    chunked_prefill = True  # prompts' slices and the running sequences' tokens go into one llama_decode
    verifies = True  # several positions of one sequence in one llama_decode, cells removed on rewind

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime  # the runtime owns the model the context uses
        self.sequence_tokens = max(256, min(runtime.context_length, STREAM_TOKENS) // 256 * 256)
        self._made: Any = None  # the llama.cpp context, made on first use
        self._retained = RetainedPrefixes()  # by a number of its own: copies of the cells, no stream held
        self._slots: dict[int, int] = {}  # sequence id → llama.cpp seq_id
        self._lengths: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}  # what each sequence's cells hold, position by position
        self._filling: set[int] = set()  # opened sequences whose prompt is still arriving
        self._next_id = 0
        self._kept = 0  # the key of the latest kept copy
        self.reused_tokens = 0  # prompt tokens taken from another sequence's cells instead of computed

    @property
    def _context(self) -> Any:
        if self._made is None:
            self._made = self._runtime.streams(self.rows, self.sequence_tokens)
            self._made.clear()
        return self._made

    def reserve(self, rows: int) -> None:
        self.rows = max(self.rows, rows)
        _ = self._context  # made now, while nobody waits

    @property
    def active(self) -> int:
        return len(self._slots)

    def open(self, prompt: list[int] | None = None) -> tuple[int, int]:
        """A new sequence; with `prompt`, holding already the longest start of it another sequence holds (at
        most all but its last token). (its id, how many of the prompt's tokens it holds)."""
        context = self._context
        if prompt is not None and len(prompt) >= self.sequence_tokens:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens does not fit a stream of {self.sequence_tokens}"
            )
        running = list(self._tokens.items())
        shared, row, kept = (
            shared_start(prompt or [], [held for _, held in running], self._retained)
            if self.reuse_prefixes
            else (0, None, None)
        )
        free = sorted(set(range(context.sequences)) - set(self._slots.values()))
        if not free:
            raise ValueError(f"the decoder already steps {context.sequences} sequences")
        slot = free[0]
        if kept is not None:  # a kept copy of a finished sequence's cells goes into this stream
            context.restore(self._retained.use(kept), slot)
            context.truncate(slot, shared)
        elif row is not None and shared:
            context.share(self._slots[running[row][0]], slot, shared)
        else:
            shared = 0
        self._next_id += 1
        sequence = self._next_id
        self._slots[sequence], self._lengths[sequence] = slot, shared
        self._tokens[sequence] = list(prompt[:shared]) if shared else []
        self._filling.add(sequence)  # not stepped until its prompt is in (`add`, or a `last` chunk)
        self.reused_tokens += shared
        return sequence, shared

    def add(self, prompt: list[int]) -> tuple[int, Any]:
        sequence, held = self.open(prompt)
        self.steps += 1
        try:
            (logits,) = self._context.decode([(self._slots[sequence], prompt[held:], held, False)])
        except Exception:
            self.remove(sequence)
            raise
        self._lengths[sequence], self._tokens[sequence] = len(prompt), list(prompt)
        self._filling.discard(sequence)
        return sequence, logits[-1]

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        stepped, _ = self.step_with_prefills(tokens, [])
        return stepped

    def step_with_prefills(
        self, tokens: dict[int, int], fills: list[tuple[int, list[int], bool]]
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        """The running sequences' tokens and every fill's chunk in one `llama_decode`, as llama-server batches."""
        running = set(self._slots) - self._filling
        if set(tokens) != running:
            raise ValueError(
                f"step needs a token for every running sequence {sorted(running)}, got {sorted(tokens)}"
            )
        for sequence, chunk, _ in fills:
            if sequence not in self._filling or not chunk:
                raise ValueError(
                    f"sequence {sequence} is not an opened one still filling, or its chunk is empty"
                )
        self.steps += 1
        order = sorted(running)
        work = [(self._slots[s], [tokens[s]], self._lengths[s], False) for s in order]
        work += [(self._slots[s], chunk, self._lengths[s], False) for s, chunk, _ in fills]
        logits = self._context.decode(work)
        for sequence in order:
            self._lengths[sequence] += 1
            self._tokens[sequence].append(tokens[sequence])
        for sequence, chunk, last in fills:
            self._lengths[sequence] += len(chunk)
            self._tokens[sequence].extend(chunk)
            if last:  # its prompt is complete: it steps with the others from the next call on
                self._filling.discard(sequence)
        stepped = {sequence: rows[-1] for sequence, rows in zip(order, logits, strict=False)}
        filled = {s: rows[-1] for (s, _, _), rows in zip(fills, logits[len(order) :], strict=True)}
        return stepped, filled

    def verify(self, sequence: int, tokens: list[int]) -> Any:
        if set(self._slots) - self._filling != {sequence}:
            raise ValueError(f"verify runs sequence {sequence} alone; running: {sorted(self._slots)}")
        self.steps += 1
        (logits,) = self._context.decode([(self._slots[sequence], tokens, self._lengths[sequence], True)])
        self._lengths[sequence] += len(tokens)
        self._tokens[sequence].extend(tokens)
        return logits

    def rewind(self, sequence: int, length: int) -> None:
        if length < self._lengths[sequence]:
            self._context.truncate(self._slots[sequence], length)
            self._lengths[sequence] = length
            del self._tokens[sequence][length:]

    def remove(self, sequence: int) -> None:
        slot, tokens = self._slots.pop(sequence), self._tokens.pop(sequence)
        del self._lengths[sequence]
        filling = sequence in self._filling
        self._filling.discard(sequence)
        if not filling and self.reuse_prefixes and 1 < len(tokens) <= self.retain_tokens:
            budget = retain_budget(self.retain_tokens, self._runtime._model.kv_bytes_per_token)
            self._kept += 1
            self._retained.keep(self._kept, tokens, self._context.save(slot), budget)
        self._context.forget(slot)

"""The torch engine's batch decoder for half-precision variants on a CPU: every running sequence and the joining
prompts' slices in one forward call per step, over a KV cache of fixed rows.

Each sequence owns a row of one key and one value buffer per layer ([rows, kv heads, capacity, head size]) and sits
at its own position in it. A step lays every token it carries side by side, whatever row it belongs to: one token
per running sequence, then the slices of the prompts joining (`open` + `step_with_prefills`, under the server's
token budget, as vLLM's CPU build schedules them). The projections, MLP and norms, nearly all the work, run once
over all those tokens (bfloat16 GEMMs, on AMX where the CPU has it); only attention goes row by row: one call for
the running rows (one query each, a mask letting each see its own positions) and one per prompt slice (causal from
where its row stands). Each token's key and value are written at its row's position, so sequences of any lengths
step together without padding. The rows in use stay the buffer's first ones, running rows before filling ones:
a prompt that completes takes the first filling row's place and a leaving sequence's row is taken by the last
row. The buffers grow (twice the rows, or the positions) only when they must.

Prefix reuse, as the ONNX decoder does it: a newcomer whose prompt starts like a row's tokens, or like a finished
sequence's kept with `retain_tokens` (a copy of its keys and values, least recently used out first), gets those
positions copied into its row and runs only the rest of its prompt.

The step is written against the model's own modules (norms, projections, rotary embedding, MLP), so it covers the
Llama-shaped decoders (Llama, Mistral, Qwen2: `STEPPED`); other architectures keep stepping each sequence alone.
Batched tokens change the order of floating-point sums, so a step matches stepping alone to bfloat16 rounding, not
bit for bit (tests/model/test_torch_slots.py states the tolerance): the reason fp32 variants keep stepping alone.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from tasks.engines.contract import (
    BatchDecoder,
    RetainedPrefixes,
    free_memory,
    retain_budget,
    shared_start,
    touch,
)
from tasks.engines.pytorch.linears import LinearMaps, cache_zeros, packed_linear_works

# decoder layers whose forward is exactly: x + o(attn(rope(q, k), v)) after the input norm, then x + mlp(norm(x))
STEPPED = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
# Positions per row set up before the first request (`reserve`; untouched memory costs nothing)
RESERVED_POSITIONS = 512


def steps_in_slots(model: Any) -> bool:
    """Whether `model`'s decoder layers are ones `SlotBatchDecoder` steps (plain torch modules, Llama-shaped)."""
    import sys

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or getattr(model, "hf_quantizer", None) is not None:
        return False
    config = model.config  # a model that windows its own attention (Mistral's default) keeps a windowed cache
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    stepped = all(type(layer).__name__ in STEPPED for layer in layers)
    return stepped and hasattr(sys.modules[type(layers[0].self_attn).__module__], "apply_rotary_pos_emb")


def _linear_bytes(model: Any) -> int:
    return sum(
        module.weight.numel() * module.weight.element_size()
        for module in model.modules()
        if type(module).__name__ == "Linear"
    )


def _packs(model: Any) -> bool:
    """Whether the step packs `model`'s linear weights (`LinearMaps`): bfloat16 on a CPU whose torch has oneDNN's
    packed linear, with room for the packed copy and as much again to spare (the model's own weights stay for its
    other callers); a packed map checked against the plain one on a few rows first."""
    import torch

    weight = model.lm_head.weight
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return False
    if free_memory() < 2 * _linear_bytes(model):
        return False
    return packed_linear_works(model.model.layers[0].self_attn.o_proj.weight)


def running_mask(position: Any, span: int, dtype: Any) -> Any:
    """The attention mask of running rows, one query each at `position` (a tensor, one per row): every key up to
    its own position among the first `span` ([rows, 1, 1, span], 0 or -inf)."""
    import torch

    seen = torch.arange(span, device=position.device)[None, :] <= position[:, None]
    mask = torch.zeros(position.shape[0], 1, 1, span, dtype=dtype, device=position.device)
    return mask.masked_fill_(~seen[:, None, None, :], float("-inf"))


# model -> (per layer (qkv, o, gate_up, down), head): built once per model (under the lock), gone with it
_PACKED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_PACKING = threading.Lock()


def _layer_weights(model: Any) -> tuple[list[tuple[Any, Any, Any, Any]], Any]:
    """The step's linear maps of `model` (see `LinearMaps`), built on first use and kept while the model lives."""
    with _PACKING:
        if model not in _PACKED:
            pack = _packs(model)
            layers = [
                (
                    LinearMaps(
                        [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], pack
                    ),
                    LinearMaps([layer.self_attn.o_proj], pack),
                    LinearMaps([layer.mlp.gate_proj, layer.mlp.up_proj], pack),
                    LinearMaps([layer.mlp.down_proj], pack),
                )
                for layer in model.model.layers
            ]
            _PACKED[model] = (layers, LinearMaps([model.lm_head], pack))
        return _PACKED[model]


class SlotBatchDecoder(BatchDecoder):
    """Sequences in rows of fixed KV buffers; running rows and joining prompts' slices in one forward call per
    step (see the module docstring)."""

    chunked_prefill = True  # prompt slices share the running rows' call

    def __init__(self, model: Any, no_grad: Any, device: Any) -> None:
        import sys

        import torch

        self._model, self._no_grad, self._device = model, no_grad, device
        config = model.config
        self._layers = model.model.layers
        # the model's own rotary function (looked up once: a compiled step traces no module table)
        self._rotate = sys.modules[type(self._layers[0].self_attn).__module__].apply_rotary_pos_emb
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_size = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._dtype = model.get_input_embeddings().weight.dtype
        self._keys: list[Any] = []  # per layer: [rows, kv heads, capacity, head size]
        self._values: list[Any] = []
        # sequence id of each row in use, in row order: running rows, then filling ones
        self._ids: list[int] = []
        self._running = 0  # how many of the first rows run (their prompts complete)
        self._tokens: list[list[int]] = []  # what each row's cache holds, position by position
        self._lengths = torch.zeros(0, dtype=torch.long)  # tokens in each row's cache
        self._next_id = 0
        # finished sequences kept for prefix reuse: per layer a copy of (keys, values) [kv heads, tokens, head size]
        self._retained = RetainedPrefixes()
        self.reused_tokens = 0  # prompt tokens copied from another row's cache instead of computed
        # the linear maps, packed when they can be: here, not in the first request's step
        self._weights, self._head = _layer_weights(model)

    @property
    def active(self) -> int:
        return len(self._ids)

    def reserve(self, rows: int) -> None:
        if self._ids:  # (rows in use would be copied: only before the first)
            return
        self._room(rows, RESERVED_POSITIONS)
        touch([*self._keys, *self._values])

    def _room(self, rows: int, positions: int) -> None:
        """Buffers with at least `rows` rows of `positions` positions (doubling; the rows in use copied over)."""

        have_rows, have_positions = (self._keys[0].shape[0], self._keys[0].shape[2]) if self._keys else (0, 0)
        if rows <= have_rows and positions <= have_positions:
            return
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows, 4)
        new_positions = (
            have_positions if positions <= have_positions else max(positions, 2 * have_positions, 256)
        )
        shape = (new_rows, self._kv_heads, new_positions, self._head_size)
        used = len(self._ids)
        # every new buffer first, then swapped in: running out of memory here leaves the old ones whole
        grown = [[cache_zeros(shape, self._dtype, self._device) for _ in self._layers] for _ in range(2)]
        for old, new in zip((self._keys, self._values), grown, strict=True):
            for layer, buffer in enumerate(old):
                new[layer][:used, :, :have_positions] = buffer[:used]
        self._keys, self._values = grown

    def open(self, prompt: list[int] | None = None) -> tuple[int, int]:
        """A new sequence in the next free row, fed by `step_with_prefills`; with `prompt`, holding already the
        longest start of it (all but its last token at most) a row or a kept finished sequence holds. (its id, how
        many of the prompt's tokens it holds)."""
        import torch

        prompt = prompt or []
        row = len(self._ids)
        shared, source, kept = (
            shared_start(prompt, self._tokens, self._retained) if self.reuse_prefixes else (0, None, None)
        )
        self._room(row + 1, shared + 1)
        if kept is not None:
            for layer, (keys, values) in enumerate(self._retained.use(kept)):
                self._keys[layer][row, :, :shared] = keys[:, :shared]
                self._values[layer][row, :, :shared] = values[:, :shared]
        elif source is not None:
            for buffers in (self._keys, self._values):
                for layer in buffers:
                    layer[row, :, :shared] = layer[source, :, :shared]
        self.reused_tokens += shared
        self._next_id += 1
        self._ids.append(self._next_id)
        self._tokens.append(list(prompt[:shared]))
        self._lengths = torch.cat([self._lengths, torch.tensor([shared])])
        return self._next_id, shared

    def add(self, prompt: list[int]) -> tuple[int, Any]:
        sequence, held = self.open(prompt)
        try:
            _, filled = self._run({}, [(sequence, prompt[held:], True)])
        except Exception:
            self.remove(sequence)
            raise
        return sequence, filled[sequence]

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        return self.step_with_prefills(tokens, [])[0]

    def step_with_prefills(
        self, tokens: dict[int, int], fills: list[tuple[int, list[int], bool]]
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        running = self._ids[: self._running]
        if set(tokens) != set(running):
            raise ValueError(f"step needs a token for every running sequence {sorted(running)}")
        return self._run(tokens, fills)

    def _run(
        self, tokens: dict[int, int], fills: list[tuple[int, list[int], bool]]
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        """One forward call: a token for each running row (all of them, or none), then each fill's chunk."""

        filling = self._ids[self._running :]
        for sequence, chunk, _ in fills:
            if sequence not in filling or not chunk:
                raise ValueError(
                    f"sequence {sequence} is not an opened one still filling, or its chunk is empty"
                )
        if len({sequence for sequence, _, _ in fills}) < len(fills):
            raise ValueError("a step takes one chunk per filling sequence")
        if not tokens and not fills:
            return {}, {}
        rows = [self._ids.index(sequence) for sequence, _, _ in fills]
        segments = [(row, chunk) for row, (_, chunk, _) in zip(rows, fills, strict=True)]
        decoding = self._running if tokens else 0
        ends = [int(self._lengths[row]) + len(chunk) for row, chunk in segments]
        self._room(len(self._ids), max([*ends, int(self._lengths[:decoding].max()) + 1 if decoding else 0]))
        self.steps += 1
        with self._no_grad():
            logits = self._forward([tokens[s] for s in self._ids[:decoding]], segments)
        array = logits.float().cpu().numpy()
        stepped = {sequence: array[row] for row, sequence in enumerate(self._ids[:decoding])}
        for row in range(decoding):
            self._tokens[row].append(tokens[self._ids[row]])
        self._lengths[:decoding] += 1
        filled = {}
        for index, ((sequence, chunk, _), (row, _)) in enumerate(zip(fills, segments, strict=True)):
            filled[sequence] = array[decoding + index]
            self._tokens[row].extend(chunk)
            self._lengths[row] += len(chunk)
        for sequence, _, last in fills:
            if last:  # its prompt is complete: it steps with the running rows from the next call on
                self._move(self._ids.index(sequence), self._running, swap=True)
                self._running += 1
        return stepped, filled

    def _forward(self, decoding: list[int], segments: list[tuple[int, list[int]]]) -> Any:
        """One token for each of the first `len(decoding)` rows, then each (row, chunk) of `segments` after what
        its row holds, all through the projections and MLP together: logits [rows decoded + segments, vocabulary]
        (each row's next token, each chunk's last)."""
        import torch

        model, device, head = self._model.model, self._device, self._head
        count = len(decoding)
        lengths = self._lengths
        row_of = [*range(count), *(row for row, chunk in segments for _ in chunk)]
        positions = [
            *lengths[:count].tolist(),
            *(p for row, chunk in segments for p in range(int(lengths[row]), int(lengths[row]) + len(chunk))),
        ]
        ids = torch.tensor([*decoding, *(t for _, chunk in segments for t in chunk)], device=device)
        row_index = torch.tensor(row_of, device=device)
        position = torch.tensor(positions, device=device)
        hidden = model.embed_tokens(ids)  # [tokens, hidden]
        cos, sin = model.rotary_emb(hidden[None], position[None])
        span, mask = 0, None
        if count:
            span = int(lengths[:count].max()) + 1
            mask = running_mask(position[:count], span, hidden.dtype)
        # per prompt slice: (row, first position, where its tokens start among the step's, how many, its mask:
        # causal after what its row holds; None from position 0, where the kernel's own causal path needs none)
        slices, offset = [], count
        for row, chunk in segments:
            start, size = int(lengths[row]), len(chunk)
            causal = None
            if start:
                seen = torch.ones(size, start + size, dtype=torch.bool, device=device).tril(start)
                causal = torch.zeros(size, start + size, dtype=hidden.dtype, device=device)
                causal.masked_fill_(~seen, float("-inf"))
            slices.append((row, start, offset, size, causal))
            offset += size
        hidden = self._through_layers(hidden, cos, sin, row_index, position, count, span, mask, slices)
        last = [*range(count), *(first + size - 1 for _, _, first, size, _ in slices)]
        return head(model.norm(hidden[last]))

    def _through_layers(
        self,
        hidden: Any,
        cos: Any,
        sin: Any,
        row_index: Any,
        position: Any,
        count: int,
        span: int,
        mask: Any,
        slices: list[tuple[int, int, int, int, Any]],
    ) -> Any:
        """The decoder layers over a step's tokens ([tokens, hidden]; each token's row and position): the first
        `count` are the running rows' one token each, attending over their first `span` positions under `mask`;
        each of `slices` (row, first position, first token, tokens, causal mask or None) a prompt slice. Each
        token's key and value are written at its row's position. Tensor work only, no host reads: what a GPU's
        compiled step captures whole (tasks/engines/pytorch/graph_slots.py)."""
        import torch
        import torch.nn.functional as F

        width, rotate = hidden.shape[0], self._rotate
        weights = self._weights
        sizes = weights[0][0].sizes  # q, k, v widths
        for number, layer in enumerate(self._layers):
            attention = layer.self_attn
            qkv, out, gate_up, down = weights[number]
            query, key, value = qkv(layer.input_layernorm(hidden)).split(sizes, dim=-1)
            query = query.view(width, self._heads, self._head_size).transpose(0, 1)[None]
            key = key.view(width, self._kv_heads, self._head_size).transpose(0, 1)[None]
            value = value.view(width, self._kv_heads, self._head_size).transpose(0, 1)[None]
            query, key = rotate(query, key, cos, sin)  # [1, heads, tokens, head size]
            keys, values = self._keys[number], self._values[number]
            keys[row_index, :, position] = key[0].transpose(0, 1)
            values[row_index, :, position] = value[0].transpose(0, 1)
            parts = []
            if count:  # the running rows: one query each, over its own positions
                attended = F.scaled_dot_product_attention(
                    query[0, :, :count].transpose(0, 1)[:, :, None],
                    keys[:count, :, :span],
                    values[:count, :, :span],
                    attn_mask=mask,
                    scale=attention.scaling,
                    enable_gqa=True,
                )
                parts.append(attended.reshape(count, -1))
            for row, start, first, size, causal in slices:  # a prompt slice, after what its row holds
                attended = F.scaled_dot_product_attention(
                    query[:, :, first : first + size],
                    keys[row : row + 1, :, : start + size],
                    values[row : row + 1, :, : start + size],
                    attn_mask=causal,
                    is_causal=causal is None,
                    scale=attention.scaling,
                    enable_gqa=True,
                )
                parts.append(attended[0].transpose(0, 1).reshape(size, -1))
            hidden = hidden + out(torch.cat(parts))
            gate, up = gate_up(layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
            hidden = hidden + down(layer.mlp.act_fn(gate) * up)
        return hidden

    def _move(self, source: int, target: int, swap: bool = False) -> None:
        """Put row `source` (its cache, id, tokens, length) at row `target`; with `swap`, `target`'s goes to
        `source`."""
        if source == target:
            return
        length = int(self._lengths[source])
        if swap:
            other = int(self._lengths[target])
            for buffers in (self._keys, self._values):
                for layer in buffers:
                    held = layer[target, :, :other].clone()
                    layer[target, :, :length] = layer[source, :, :length]
                    layer[source, :, :other] = held
            self._ids[source], self._ids[target] = self._ids[target], self._ids[source]
            self._tokens[source], self._tokens[target] = self._tokens[target], self._tokens[source]
            self._lengths[[source, target]] = self._lengths[[target, source]]
            return
        for buffers in (self._keys, self._values):
            for layer in buffers:
                layer[target, :, :length] = layer[source, :, :length]
        self._ids[target], self._tokens[target] = self._ids[source], self._tokens[source]
        self._lengths[target] = length

    def _retain(self, row: int) -> None:
        """Keep a copy of a leaving row's keys and values for later prompts that start like it (see the module
        docstring)."""
        held = int(self._lengths[row])
        if not self.reuse_prefixes or self.retain_tokens <= 0:
            return
        from tasks.engines.pytorch.decode_loop import device_free_bytes

        per_token = sum(2 * keys[0, :, :1].nbytes for keys in self._keys)
        budget = retain_budget(self.retain_tokens, per_token, device_free_bytes(self._device))
        self._retained.fit(budget)  # free memory may have shrunk since the last ones were kept
        if not 1 < held <= budget:
            return
        self._next_id += 1
        copies = [
            (keys[row, :, :held].clone(), values[row, :, :held].clone())
            for keys, values in zip(self._keys, self._values, strict=True)
        ]
        self._retained.keep(self._next_id, self._tokens[row][:held], copies, budget)

    def remove(self, sequence: int) -> None:
        """Forget `sequence`; the rows in use stay the first ones, running before filling (one or two rows'
        caches copied)."""
        row, last = self._ids.index(sequence), len(self._ids) - 1
        if row < self._running:
            self._retain(row)
            self._running -= 1
            self._move(self._running, row)  # the last running row takes its place
            row = self._running  # and the last row the place that frees
        self._move(last, row)
        self._ids.pop()
        self._tokens.pop()
        self._lengths = self._lengths[:last].clone()

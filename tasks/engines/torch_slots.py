"""The torch engine's batch decoder for half-precision variants on a CPU: every running sequence in one forward
call per step, over a KV cache of fixed rows.

Each sequence owns a row of one key and one value buffer per layer ([rows, kv heads, capacity, head size]) and sits
at its own position in it: a step writes each row's new key and value at that row's position and attends with a
mask that lets each row see its own positions only, so sequences of any lengths step together without padding
copies (the padded decoder re-pads every cache each step). A prompt runs alone through the model's own forward
(bfloat16 GEMMs, on AMX where the CPU has it) and its cache is copied into a free row; a leaving sequence's row is
taken by the last row. The buffers grow (twice the rows, or the positions) only when they must.

The step is written against the model's own modules (norms, projections, rotary embedding, MLP), so it covers the
Llama-shaped decoders (Llama, Mistral, Qwen2: `STEPPED`); other architectures keep stepping each sequence alone.
Batched rows change the order of floating-point sums, so a step matches stepping alone to bfloat16 rounding, not
bit for bit (tests/model/test_torch_slots.py states the tolerance): the reason fp32 variants keep stepping alone.
"""

from __future__ import annotations

from typing import Any

from tasks.engines.contract import BatchDecoder

# decoder layers whose forward is exactly: x + o(attn(rope(q, k), v)) after the input norm, then x + mlp(norm(x))
STEPPED = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")


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


class SlotBatchDecoder(BatchDecoder):
    """Sequences in rows of fixed KV buffers, all stepped in one forward call (see the module docstring)."""

    def __init__(self, model: Any, no_grad: Any, device: Any) -> None:
        import torch

        self._model, self._no_grad, self._device = model, no_grad, device
        config = model.config
        self._layers = model.model.layers
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_size = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._dtype = model.get_input_embeddings().weight.dtype
        self._keys: list[Any] = []  # per layer: [rows, kv heads, capacity, head size]
        self._values: list[Any] = []
        self._ids: list[int] = []  # sequence id of each row in use, in row order
        self._lengths = torch.zeros(0, dtype=torch.long)  # tokens in each row's cache
        self._next_id = 0

    @property
    def active(self) -> int:
        return len(self._ids)

    def _room(self, rows: int, positions: int) -> None:
        """Buffers with at least `rows` rows of `positions` positions (doubling; the rows in use copied over)."""
        import torch

        have_rows, have_positions = (self._keys[0].shape[0], self._keys[0].shape[2]) if self._keys else (0, 0)
        if rows <= have_rows and positions <= have_positions:
            return
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows, 4)
        new_positions = (
            have_positions if positions <= have_positions else max(positions, 2 * have_positions, 256)
        )
        shape = (new_rows, self._kv_heads, new_positions, self._head_size)
        used = len(self._ids)
        for buffers in (self._keys, self._values):
            for layer in range(len(self._layers)):
                grown = torch.zeros(shape, dtype=self._dtype, device=self._device)
                if layer < len(buffers):
                    grown[:used, :, :have_positions] = buffers[layer][:used]
                    buffers[layer] = grown
                else:
                    buffers.append(grown)

    def add(self, prompt: list[int]) -> tuple[int, Any]:
        import torch

        self.steps += 1
        with self._no_grad():
            out = self._model(
                input_ids=torch.tensor([prompt], device=self._device), use_cache=True, logits_to_keep=1
            )
        cache = out.past_key_values
        row = len(self._ids)
        self._room(row + 1, len(prompt) + 1)
        for layer, cached in enumerate(cache.layers):
            self._keys[layer][row, :, : len(prompt)] = cached.keys[0]
            self._values[layer][row, :, : len(prompt)] = cached.values[0]
        self._next_id += 1
        self._ids.append(self._next_id)
        self._lengths = torch.cat([self._lengths, torch.tensor([len(prompt)])])
        return self._next_id, out.logits[0, -1].float().cpu().numpy()

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        import torch

        if set(tokens) != set(self._ids):
            raise ValueError(f"step needs a token for every active sequence {sorted(self._ids)}")
        if not self._ids:
            return {}
        rows = len(self._ids)
        self._room(rows, int(self._lengths.max()) + 1)
        self.steps += 1
        with self._no_grad():
            ids = torch.tensor([tokens[s] for s in self._ids], device=self._device)
            logits = self._forward(ids, self._lengths.to(self._device))
        self._lengths += 1
        array = logits.float().cpu().numpy()
        return {sequence: array[row] for row, sequence in enumerate(self._ids)}

    def _forward(self, ids: Any, positions: Any) -> Any:
        """One token per row at each row's own position: logits [rows, vocabulary]."""
        import sys

        import torch
        import torch.nn.functional as F

        model = self._model.model
        rows, span = ids.shape[0], int(positions.max()) + 1
        hidden = model.embed_tokens(ids)[:, None, :]
        cos, sin = model.rotary_emb(hidden, positions[:, None])
        seen = torch.arange(span, device=self._device)[None, :] <= positions[:, None]
        mask = torch.zeros(rows, 1, 1, span, dtype=hidden.dtype, device=self._device)
        mask.masked_fill_(~seen[:, None, None, :], float("-inf"))
        index = torch.arange(rows, device=self._device)
        for number, layer in enumerate(self._layers):
            attention = layer.self_attn
            normed = layer.input_layernorm(hidden)
            query = attention.q_proj(normed).view(rows, 1, self._heads, self._head_size).transpose(1, 2)
            key = attention.k_proj(normed).view(rows, 1, self._kv_heads, self._head_size).transpose(1, 2)
            value = attention.v_proj(normed).view(rows, 1, self._kv_heads, self._head_size).transpose(1, 2)
            rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the model's own
            query, key = rotate(query, key, cos, sin)
            keys, values = self._keys[number], self._values[number]
            keys[index, :, positions] = key[:, :, 0]
            values[index, :, positions] = value[:, :, 0]
            attended = F.scaled_dot_product_attention(
                query,
                keys[:rows, :, :span],
                values[:rows, :, :span],
                attn_mask=mask,
                scale=attention.scaling,
                enable_gqa=True,
            )
            hidden = hidden + attention.o_proj(attended.transpose(1, 2).reshape(rows, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self._model.lm_head(model.norm(hidden))[:, 0]

    def remove(self, sequence: int) -> None:
        row, last = self._ids.index(sequence), len(self._ids) - 1
        if row != last:  # the last row takes the leaver's place: the rows in use stay the first ones
            length = int(self._lengths[last])
            for buffers in (self._keys, self._values):
                for layer in buffers:
                    layer[row, :, :length] = layer[last, :, :length]
            self._ids[row] = self._ids[last]
            self._lengths[row] = self._lengths[last]
        self._ids.pop()
        self._lengths = self._lengths[:last].clone()

"""Prompt slices of the ONNX engine computed in bfloat16 by torch (oneDNN, AMX where the CPU has it), on the
graph's own weights, with their keys and values handed back to the graph's cache.

Why: on a CPU the builder's int4/int8 graph decodes fastest (a step reads few bytes), but its prompts run through
MatMulNBits, which never reaches AMX: ~200-350 GFLOP/s on a Xeon where oneDNN's bfloat16 matmul reaches ~1 300-1 600
(docs/results/2026-12-05-serving.md). Under load prompts are most of a server's work. So the ONNX batch decoder
keeps its steps on the graph and may run long prompt slices here: the same weights (each MatMulNBits dequantized
once, level x scale, rounded to bfloat16), activations in bfloat16 where the graph's accuracy level 4 rounds them to
int8 per block, norms and the residual stream in float32 as in the graph. Several prompts' slices share one call
(projections and MLP over all their tokens, attention per slice after what its row holds).

What is read: the model builder's decoder-only graph for a CPU (`GraphWeights.read`): an embedding lookup (a float
`Gather`, or `GatherBlockQuantized` on the lm_head's own table), per layer a `SimplifiedLayerNormalization` or
`SkipSimplifiedLayerNormalization`, q/k/v (fused or apart), `GroupQueryAttention` with its rotary caches (not
interleaved, no window, no softcap), o, gate and up, SiLU (Sigmoid x Mul), down, a final norm and the lm_head; every
matrix a MatMulNBits (4 or 8 bits, no zero points, no bias) or a float MatMul. A graph with anything else is not
read (None): its prompts run on ONNX Runtime as before. `BfloatPrompts.check` compares one prompt's last logits with
the graph's and refuses the path if they differ by more than `AGREEMENT` of the logits' spread.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tasks.engines.contract import free_memory
from tasks.engines.pytorch.slots import _Weights

log = logging.getLogger(__name__)

# the most a slice's last logits may differ from the graph's, as a share of their spread (largest - smallest):
# measured 0.4-0.9 % on SmolLM2 int4/int8 graphs and the test model (tests/model/test_onnx_prompts.py)
AGREEMENT = 0.03
PROBE_TOKENS = 96  # the prompt `faster_in_bf16` times both paths on: a typical served prompt's length
PROBE_ROUNDS = (
    3  # ... the best of this many each (the server decides at start, maybe beside other busy processes)
)
ALLOWED = {
    "MatMulNBits",
    "MatMul",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "GroupQueryAttention",
    "Sigmoid",
    "Mul",
    "Gather",
    "GatherBlockQuantized",
    "Reshape",
    "Constant",
    "Cast",
    "ReduceSum",
    "Sub",
    "Shape",
}
_LINEAR = re.compile(
    r"/model/layers\.(\d+)/(attn|mlp)/(qkv_proj|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/"
)


@dataclass
class Layer:
    norms: list[Any] = field(default_factory=list)  # input and post-attention RMSNorm weights (float32)
    linears: dict[str, Any] = field(default_factory=dict)  # projection name -> [out, in] float32 weight


@dataclass
class GraphWeights:
    """The weights of a model builder's decoder graph, dequantized to float32 (see the module docstring)."""

    embedding: Any  # [vocabulary, hidden]
    layers: list[Layer]
    final_norm: Any
    lm_head: Any  # [vocabulary, hidden]
    epsilon: float
    heads: int
    kv_heads: int
    scale: float
    cos: Any  # [positions, head size / 2]
    sin: Any

    def matrices(self) -> list[Any]:
        return [self.lm_head, *(m for layer in self.layers for m in layer.linears.values())]  # tensors

    @classmethod
    def read(cls, model_path: Path) -> GraphWeights | None:
        """The graph's weights, or None where the graph is not one this module computes."""
        import onnx
        from onnx import numpy_helper

        model = onnx.load(model_path)  # with its weights
        nodes = list(model.graph.node)
        if any(node.op_type not in ALLOWED for node in nodes):
            return None
        weights = {item.name: item for item in model.graph.initializer}
        array = _Arrays(weights, numpy_helper)
        attention = [node for node in nodes if node.op_type == "GroupQueryAttention"]
        if not attention or not all(_plain_attention(node) for node in attention):
            return None
        first = _attributes(attention[0])
        layers = [Layer() for _ in attention]
        lm_head = embedding = final_norm = None
        epsilon = None
        for node in nodes:
            kind, attributes = node.op_type, _attributes(node)
            if kind in ("MatMulNBits", "MatMul"):
                matrix = array.linear(node)
                if matrix is None:
                    return None
                found = _LINEAR.match(node.name)
                if found:
                    layers[int(found.group(1))].linears[found.group(3)] = matrix
                elif "logits" in node.output:
                    lm_head = matrix
                else:
                    return None
            elif kind.endswith("SimplifiedLayerNormalization"):
                epsilon = attributes.get("epsilon", 1e-5)
                gamma = array.get(node.input[-1] if kind.startswith("Skip") else node.input[1])
                layer = re.match(r"/model/layers\.(\d+)/", node.name)
                if gamma is None or layer is None:
                    return None
                index = int(layer.group(1))
                if index < len(layers):
                    layers[index].norms.append(gamma)
                else:
                    final_norm = gamma
            elif kind == "Gather" and node.input[0] in weights:
                embedding = array.get(node.input[0])
            elif kind == "GatherBlockQuantized":
                embedding = "lm_head"  # the lm_head's own table, reshaped (checked against it below)
        if any(len(layer.norms) != 2 or not _complete(layer.linears) for layer in layers):
            return None
        if lm_head is None or final_norm is None or embedding is None:
            return None
        if isinstance(embedding, str):
            embedding = lm_head
        cos, sin = array.get(attention[0].input[7]), array.get(attention[0].input[8])
        if cos is None or sin is None:
            return None
        heads, kv_heads = first["num_heads"], first["kv_num_heads"]
        head_size = cos.shape[1] * 2
        scale = first.get("scale") or head_size**-0.5
        return cls(embedding, layers, final_norm, lm_head, epsilon, heads, kv_heads, scale, cos, sin)


class _Arrays:
    """Initializers as float32 tensors; MatMulNBits dequantized to [out, in] (with torch: ~5x numpy's speed)."""

    def __init__(self, weights: dict[str, Any], numpy_helper: Any) -> None:
        self._weights, self._helper = weights, numpy_helper

    def get(self, name: str) -> Any:
        import torch

        item = self._weights.get(name)
        return None if item is None else torch.from_numpy(self._helper.to_array(item).astype(np.float32))

    def linear(self, node: Any) -> Any:
        import torch

        if node.op_type == "MatMul":  # a float MatMul: x @ W, W [in, out]
            weight = self.get(node.input[1])
            return None if weight is None else weight.T.contiguous()
        extra = [name for name in node.input[3:] if name]
        if extra or node.input[1] not in self._weights:  # zero points, g_idx or bias: not read here
            return None
        attributes = _attributes(node)
        bits, block = attributes["bits"], attributes["block_size"]
        rows, columns = attributes["N"], attributes["K"]
        if bits not in (4, 8):
            return None
        packed = torch.from_numpy(self._helper.to_array(self._weights[node.input[1]]).copy()).reshape(
            rows, -1
        )
        if bits == 4:  # two levels a byte, the low nibble first
            packed = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, -1)
        scales = self.get(node.input[2]).reshape(rows, -1)
        centred = packed.to(torch.float32) - float(1 << (bits - 1))  # no zero points: the middle level is 0
        blocks = centred.view(rows, scales.shape[1], block) * scales[:, :, None]
        return blocks.view(rows, -1)[:, :columns]


def _attributes(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}


def _plain_attention(node: Any) -> bool:
    """Rotary inside the op (not interleaved), no sliding window, no softcap, q/k/v packed in its first input."""
    attributes = _attributes(node)
    packed = (
        len(node.input) > 8 and not node.input[1] and not node.input[2] and node.input[7] and node.input[8]
    )
    return bool(
        packed
        and attributes.get("do_rotary") == 1
        and attributes.get("rotary_interleaved", 0) == 0
        and attributes.get("local_window_size", -1) == -1
        and not attributes.get("softcap", 0.0)
    )


def _complete(linears: dict[str, Any]) -> bool:
    attention = "qkv_proj" in linears or {"q_proj", "k_proj", "v_proj"} <= set(linears)
    return attention and {"o_proj", "gate_proj", "up_proj", "down_proj"} <= set(linears)


class BfloatPrompts:
    """Prompt slices after what their rows hold, computed in bfloat16 (see the module docstring)."""

    def __init__(self, weights: GraphWeights, names: list[str], dtype: Any = None) -> None:
        """`names`: the cache inputs (`past_key_values.N.key|value`) in the order callers hand caches over."""
        import torch

        self._order = [
            (names.index(f"past_key_values.{n}.key"), names.index(f"past_key_values.{n}.value"))
            for n in range(len(weights.layers))
        ]
        self._inputs = len(names)

        bf16 = self._dtype = dtype or torch.bfloat16  # float32: the exact reference the tests compare with
        self._heads, self._kv_heads, self._scale = weights.heads, weights.kv_heads, weights.scale
        self._epsilon = weights.epsilon
        self._cos, self._sin = weights.cos, weights.sin
        self._head_size = weights.cos.shape[1] * 2
        pack = _packs() and bf16 == torch.bfloat16

        def maps(*matrices: Any) -> _Weights:
            joined = torch.cat(matrices).to(bf16)
            return _Weights([SimpleNamespace(weight=joined, bias=None)], pack)

        self._embedding = weights.embedding.to(bf16)
        self._layers = []
        for layer in weights.layers:
            linears = layer.linears
            qkv = (
                [linears["qkv_proj"]]
                if "qkv_proj" in linears
                else [linears["q_proj"], linears["k_proj"], linears["v_proj"]]
            )
            self._layers.append(
                (
                    layer.norms,
                    maps(*qkv),
                    maps(linears["o_proj"]),
                    maps(linears["gate_proj"], linears["up_proj"]),
                    maps(linears["down_proj"]),
                )
            )
        self._final_norm = weights.final_norm
        self._head = maps(weights.lm_head)

    def _norm(self, x: Any, gamma: Any) -> Any:
        """RMSNorm computed in float32 (as the graph's stash type), returned in the path's dtype."""
        import torch.nn.functional as F

        return F.rms_norm(x.float(), gamma.shape, gamma, self._epsilon).to(self._dtype)

    def run(
        self, slices: list[tuple[list[np.ndarray], list[int]]]
    ) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        """For each (its row's cache: per cache input in the order of `names`, [1, kv heads, held, head size]
        float32; its tokens): the logits after its last token and its cache with the slice's keys and values
        appended (float32, the same order)."""
        import torch
        import torch.nn.functional as F

        bf16 = self._dtype
        with torch.inference_mode():
            held = [int(cache[0].shape[2]) for cache, _ in slices]
            sizes = [len(tokens) for _, tokens in slices]
            ids = torch.tensor([t for _, tokens in slices for t in tokens])
            position = torch.tensor([p for h, n in zip(held, sizes, strict=True) for p in range(h, h + n)])
            half = self._cos[position][None]  # [1, tokens, head size / 2]
            cos = torch.cat([half, half], dim=-1).to(bf16)  # both halves turn by the same angle
            half = self._sin[position][None]
            sin = torch.cat([-half, half], dim=-1).to(bf16)  # the first half's partner is subtracted
            hidden = self._embedding[ids]  # [tokens, hidden] bfloat16
            width, size = len(ids), self._head_size
            heads, kv_heads = self._heads, self._kv_heads
            caches: list[list[Any]] = [[None] * self._inputs for _ in slices]
            for (at_k, at_v), (norms, qkv, out, gate_up, down) in zip(self._order, self._layers, strict=True):
                mixed = qkv(self._norm(hidden, norms[0]))
                query, key, value = mixed.split([heads * size, kv_heads * size, kv_heads * size], dim=-1)
                query = _rotate(query.view(width, heads, size).transpose(0, 1), cos, sin)
                key = _rotate(key.view(width, kv_heads, size).transpose(0, 1), cos, sin)
                value = value.view(width, kv_heads, size).transpose(0, 1)
                parts, first = [], 0
                for index, (cache, _) in enumerate(slices):
                    count, start = sizes[index], held[index]
                    new_k, new_v = key[:, first : first + count], value[:, first : first + count]
                    keys, values = new_k, new_v
                    if start:
                        keys = torch.cat([torch.from_numpy(cache[at_k][0]).to(bf16), new_k], dim=1)
                        values = torch.cat([torch.from_numpy(cache[at_v][0]).to(bf16), new_v], dim=1)
                    caches[index][at_k] = np.concatenate([cache[at_k], new_k.float().numpy()[None]], axis=2)
                    caches[index][at_v] = np.concatenate([cache[at_v], new_v.float().numpy()[None]], axis=2)
                    seen = torch.ones(count, start + count, dtype=torch.bool).tril(start) if start else None
                    attended = F.scaled_dot_product_attention(
                        query[None, :, first : first + count],
                        keys[None],
                        values[None],
                        attn_mask=seen,
                        is_causal=not start,
                        scale=self._scale,
                        enable_gqa=True,
                    )
                    parts.append(attended[0].transpose(0, 1).reshape(count, -1))
                    first += count
                hidden = hidden + out(torch.cat(parts))
                gate, up = gate_up(self._norm(hidden, norms[1])).chunk(2, dim=-1)
                hidden = hidden + down(F.silu(gate) * up)
            last = torch.tensor(np.cumsum(sizes) - 1)
            logits = self._head(self._norm(hidden[last], self._final_norm)).float().numpy()
        return [(logits[index], caches[index]) for index in range(len(slices))]


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding, halves not interleaved: x [heads, tokens, head size]; cos [1, tokens, size] (each angle's
    cosine twice), sin [1, tokens, size] (its sine negated, then as is): (x1 cos - x2 sin, x2 cos + x1 sin)."""
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def faster_in_bf16(
    model_path: Path, names: list[str], run_alone: Callable[[list[int], list[Any]], tuple[Any, list[Any]]]
) -> BfloatPrompts | None:
    """The bfloat16 path for this graph where it is worth having: the graph is one it reads, the machine has room
    for its weights, its logits for a probe prompt agree with ONNX Runtime's (`run_alone(tokens, empty cache)`)
    within `AGREEMENT` of their spread, and it runs that prompt faster here (best of `PROBE_ROUNDS` each). None
    otherwise (a CPU without bfloat16 matrix instructions, AMX or AVX-512 BF16, is not probed), the verdict in the
    log."""
    import time

    if not _bf16_matmul_in_hardware():
        log.info(
            "%s: this CPU has no bfloat16 matrix instructions: prompts stay on ONNX Runtime",
            model_path.parent.name,
        )
        return None
    weights = GraphWeights.read(model_path)
    if weights is None:
        log.info("%s: not a graph the bfloat16 prompt path reads", model_path.parent.name)
        return None
    if free_memory() < 3 * 2 * sum(m.numel() for m in weights.matrices()):
        log.info("%s: no room for a bfloat16 copy of the weights", model_path.parent.name)
        return None
    prompts = BfloatPrompts(weights, names)
    size = weights.cos.shape[1] * 2
    empty = [np.zeros((1, weights.kv_heads, 0, size), np.float32) for _ in names]
    probe = [(37 * index) % (weights.embedding.shape[0] - 3) + 3 for index in range(PROBE_TOKENS)]
    calls = {"bf16": lambda: prompts.run([(empty, probe)])[0][0], "onnx": lambda: run_alone(probe, empty)[0]}
    took, logits = {}, {}
    for name in [*calls] * PROBE_ROUNDS:  # best of each, interleaved
        started = time.perf_counter()
        logits[name] = calls[name]()
        took[name] = min(took.get(name, float("inf")), time.perf_counter() - started)
    ours, theirs = logits["bf16"], logits["onnx"]
    spread = float(theirs.max() - theirs.min())
    apart = float(np.abs(ours - theirs).max()) / spread if spread else float("inf")
    if not apart <= AGREEMENT:
        log.warning(
            "%s: bfloat16 prompts differ from ONNX Runtime's by %.3f of the logits' spread; not used",
            model_path,
            apart,
        )
        return None
    verdict = "used" if took["bf16"] < took["onnx"] else "not used"
    log.info(
        "%s: a %d-token prompt in bfloat16 %.1f ms, on ONNX Runtime %.1f ms: bfloat16 prompts %s",
        model_path.parent.name,
        PROBE_TOKENS,
        1e3 * took["bf16"],
        1e3 * took["onnx"],
        verdict,
    )
    return prompts if verdict == "used" else None


def _bf16_matmul_in_hardware() -> bool:
    """Whether the CPU multiplies bfloat16 matrices in hardware (AMX or AVX-512 BF16, from /proc/cpuinfo's flags);
    elsewhere oneDNN emulates bfloat16 and the path cannot pay. True where the flags cannot be read (the probe
    decides there)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _packs() -> bool:
    """Whether oneDNN's packed bfloat16 linear is there and right on this CPU (see
    `tasks.engines.pytorch.slots._Weights`): a packed matrix checked against `F.linear` on a few rows."""
    import torch

    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_reorder_linear_weight"):
        return False
    try:
        weight = torch.randn(32, 64, dtype=torch.bfloat16)
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        got = _Weights([SimpleNamespace(weight=weight, bias=None)], pack=True)(x)
        return bool(torch.allclose(got, torch.nn.functional.linear(x, weight), rtol=0.02, atol=0.02))
    except (RuntimeError, AttributeError):  # a oneDNN build without bfloat16 matmul on this CPU
        return False

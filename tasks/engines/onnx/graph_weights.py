"""The weights of a model builder's decoder graph for a CPU, read back as float32 tensors (every MatMulNBits
dequantized), for computing its prompts elsewhere (tasks/engines/onnx/bf16_prompts.py). What is read: an embedding
lookup (a float `Gather`, or `GatherBlockQuantized` on the lm_head's own table), per layer a
`SimplifiedLayerNormalization` or `SkipSimplifiedLayerNormalization`, the fused q/k/v projection,
`GroupQueryAttention` with its rotary caches over the whole head (not interleaved, no window, no softcap, no extra
inputs), o, gate and up, SiLU (Sigmoid x Mul), down, a final norm and the lm_head; every matrix a MatMulNBits (4 or
8 bits, no zero points, no bias) or a float MatMul. A graph with anything else is not read (None)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
_LINEAR = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(qkv_proj|o_proj|gate_proj|up_proj|down_proj)/")


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
        import torch
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
        found = _walk(nodes, weights, array, layers)
        if found is None:
            return None
        lm_head, embedding, final_norm, epsilon = found
        if any(len(layer.norms) != 2 or not _complete(layer.linears) for layer in layers):
            return None
        if lm_head is None or final_norm is None or embedding is None:
            return None
        if not isinstance(
            embedding, torch.Tensor
        ):  # a GatherBlockQuantized: the lm_head's table, or not read
            if not _shares_head_table(embedding, nodes):
                return None
            embedding = lm_head
        cos, sin = array.get(attention[0].input[7]), array.get(attention[0].input[8])
        if cos is None or sin is None:
            return None
        heads, kv_heads = first["num_heads"], first["kv_num_heads"]
        head_size = cos.shape[1] * 2  # rotary over the whole head (the caller checks its cache's shape)
        scale = first.get("scale") or head_size**-0.5
        return cls(embedding, layers, final_norm, lm_head, epsilon, heads, kv_heads, scale, cos, sin)


def _walk(nodes: list[Any], weights: dict[str, Any], array: _Arrays, layers: list[Layer]) -> tuple | None:
    """Each layer's matrices and norms into `layers`; (the lm_head, the embedding table — or the lookup node to
    check —, the final norm, the norms' epsilon), or None at a node this module does not read."""
    lm_head = embedding = final_norm = None
    epsilon = None
    for node in nodes:
        kind, attributes = node.op_type, _attributes(node)
        if kind in ("MatMulNBits", "MatMul"):
            matrix = array.linear(node)
            if matrix is None:
                return None
            found = _LINEAR.match(node.name)
            if found and int(found.group(1)) < len(layers):
                layers[int(found.group(1))].linears[found.group(3)] = matrix
            elif "logits" in node.output:
                lm_head = matrix
            else:
                return None
        elif kind.endswith("SimplifiedLayerNormalization"):
            epsilon = attributes.get("epsilon", 1e-5)
            gamma = array.get(node.input[2] if kind.startswith("Skip") else node.input[1])
            if kind.startswith("Skip") and len([name for name in node.input if name]) > 3:
                return None  # a bias added before the norm: not read
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
            embedding = node  # only the lm_head's own table, reshaped (checked by the caller), is read
    return lm_head, embedding, final_norm, epsilon


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
    """Rotary inside the op (not interleaved), no sliding window, no softcap or smooth softmax, q/k/v packed in its
    first input, no position ids, attention bias or head sink."""
    attributes = _attributes(node)
    packed = (
        len(node.input) > 8 and not node.input[1] and not node.input[2] and node.input[7] and node.input[8]
    )
    packed = packed and not any(node.input[9:])
    return bool(
        packed
        and attributes.get("do_rotary") == 1
        and attributes.get("rotary_interleaved", 0) == 0
        and attributes.get("local_window_size", -1) == -1
        and not attributes.get("softcap", 0.0)
        and not attributes.get("smooth_softmax", 0)
    )


def _shares_head_table(gather: Any, nodes: list[Any]) -> bool:
    """Whether a GatherBlockQuantized looks up the lm_head's own quantized table (its data a Reshape of the lm_head
    MatMulNBits' weight, its scales the lm_head's), as tasks/engines/onnx/weights.py and the builder write it."""
    head = next((node for node in nodes if "logits" in node.output), None)
    source = next((node for node in nodes if gather.input[0] in node.output), None)
    return bool(
        head is not None
        and head.op_type == "MatMulNBits"
        and source is not None
        and source.op_type == "Reshape"
        and source.input[0] == head.input[1]
        and gather.input[2] == head.input[2]
        and not any(gather.input[3:])
    )


def _complete(linears: dict[str, Any]) -> bool:
    return {"qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} == set(linears)

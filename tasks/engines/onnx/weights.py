"""Weights written into an exported ONNX Runtime GenAI model after its model builder ran.

- Integer weights: the int4 MatMulNBits nodes get the levels and scales llmopt computed (GPTQ, importance-weighted
  scales: tasks/techniques/gptq_rounding.py) in place of the builder's round-to-nearest. MatMulNBits stores
  B as uint8 (out × blocks × block/2, two levels per byte, low nibble first, level + 8) and one scale per block;
  symmetric exports have no zero points (8 is implied).
- A tied 8-bit lm_head: the builder shares the embedding table with the lm_head only at int4; with an int8 lm_head
  it keeps a second, float32 copy of the table for the embedding lookup (4 bytes a weight: for SmolLM2 113 MB of
  its 160). Here the lookup becomes a GatherBlockQuantized (8 bits) on the lm_head's own int8 table.

The model is rewritten with onnx-ir into a staging folder and moved over the old files; `read_int4` reads a node's
levels and scales back, so a build can check the graph holds exactly what was planned.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from tasks.errors import BuildError
from tasks.techniques.gptq_rounding import BlockwiseInt

MODEL_FILE = "model.onnx"
EMBEDDING_GATHER = "/model/embed_tokens/Gather"
LM_HEAD = "/lm_head/MatMul"


def _attribute(node: Any, name: str, default: int | None = None) -> int | None:
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def _int4_nodes(model: Any) -> dict[str, Any]:
    """The 4-bit MatMulNBits nodes by name without their _Q4 suffix (the names mixed_precision.export_matrices uses)."""
    return {
        node.name.rsplit("_Q", 1)[0]: node
        for node in model.graph
        if node.op_type == "MatMulNBits" and _attribute(node, "bits") == 4
    }


def pack_int4(weights: BlockwiseInt) -> tuple[Any, Any]:
    """MatMulNBits' B (uint8, out × blocks × block/2) and scales (float32, out × blocks) of symmetric int4 weights."""
    import numpy as np

    levels = weights.levels.numpy().astype(np.int16) + 8
    rows, columns = levels.shape
    blocks = weights.scales.shape[1]
    padded = np.full((rows, blocks * weights.block), 8, dtype=np.uint8)  # padding: level 0
    padded[:, :columns] = levels.astype(np.uint8)
    pairs = padded.reshape(rows, blocks, weights.block // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return packed, weights.scales.numpy().astype(np.float32)


def read_int4(folder: Path, node_names: list[str]) -> dict[str, BlockwiseInt]:
    """The levels and scales exported 4-bit MatMulNBits nodes hold, by node name (the model is read once)."""
    import numpy as np
    import onnx_ir as ir
    import torch

    nodes = _int4_nodes(ir.load(folder / MODEL_FILE))
    found = {}
    for name in node_names:
        node = nodes.get(name)
        if node is None:
            raise BuildError(f"onnx_genai: {folder / MODEL_FILE} has no 4-bit MatMulNBits node {name}")
        packed = node.inputs[1].const_value.numpy()
        scales = node.inputs[2].const_value.numpy()
        rows, columns, block = _attribute(node, "N"), _attribute(node, "K"), _attribute(node, "block_size")
        levels = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)[:, :columns]
        found[name] = BlockwiseInt(
            torch.from_numpy(levels.astype(np.int8) - 8),
            torch.from_numpy(scales.reshape(rows, -1).astype(np.float32)),
            block,
        )
    return found


def write_weights(folder: Path, int4: dict[str, BlockwiseInt], share_int8_lm_head: bool) -> None:
    """Put `int4` (node name → its weights; q/k/v rows stacked for the fused node) into the exported graph, and
    with `share_int8_lm_head` let the embedding lookup read a tied int8 lm_head's table (a BuildError if it
    cannot)."""
    import onnx_ir as ir

    path = folder / MODEL_FILE
    model = ir.load(path)
    nodes = _int4_nodes(model)
    for name, weights in int4.items():
        node = nodes.get(name)
        if node is None:
            raise BuildError(f"onnx_genai: the exported graph has no 4-bit MatMulNBits node {name} to write")
        shape = (_attribute(node, "N"), _attribute(node, "K"))
        if tuple(weights.levels.shape) != shape or _attribute(node, "block_size") != weights.block:
            raise BuildError(
                f"onnx_genai: {name} is {shape} in blocks of {_attribute(node, 'block_size')} in the graph, "
                f"the rounded weights {tuple(weights.levels.shape)} in blocks of {weights.block}"
            )
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            raise BuildError(f"onnx_genai: {name} has zero points; llmopt writes symmetric int4 only")
        packed, scales = pack_int4(weights)
        for value, array in ((node.inputs[1], packed), (node.inputs[2], scales)):
            value.const_value = ir.tensor(array.reshape(value.const_value.shape.numpy()), name=value.name)
    if share_int8_lm_head and not _share_lm_head_table(model):
        raise BuildError("onnx_genai: the exported embedding lookup could not be pointed at the int8 lm_head")
    with tempfile.TemporaryDirectory(prefix="onnx-weights-", dir=folder) as staging:
        staged = Path(staging) / MODEL_FILE
        ir.save(model, staged, external_data=f"{MODEL_FILE}.data")
        for file in (MODEL_FILE, f"{MODEL_FILE}.data"):
            shutil.move(Path(staging) / file, folder / file)


def _share_lm_head_table(model: Any) -> bool:
    """Replace a float Gather of the embedding table by a GatherBlockQuantized on the int8 lm_head's table."""
    import numpy as np
    import onnx_ir as ir

    gather = next((n for n in model.graph if n.name == EMBEDDING_GATHER and n.op_type == "Gather"), None)
    head = next((n for n in model.graph if n.name == f"{LM_HEAD}_Q8" and n.op_type == "MatMulNBits"), None)
    if gather is None or head is None or (len(head.inputs) > 3 and head.inputs[3] is not None):
        return False
    table, ids = gather.inputs[0], gather.inputs[1]
    rows, columns, block = _attribute(head, "N"), _attribute(head, "K"), _attribute(head, "block_size")
    if (
        table.const_value is None
        or tuple(table.const_value.shape.numpy()) != (rows, columns)
        or columns % block
    ):
        return False
    shape = ir.Value(name="/model/embed_tokens/table_shape", const_value=ir.tensor(np.array([rows, columns])))
    model.graph.register_initializer(shape)
    reshape = ir.node("Reshape", [head.inputs[1], shape], name="/model/embed_tokens/Reshape")
    lookup = ir.node(
        "GatherBlockQuantized",
        [reshape.outputs[0], ids, head.inputs[2]],
        attributes={"bits": 8, "block_size": block, "gather_axis": 0, "quantize_axis": 1},
        domain="com.microsoft",
        name="/model/embed_tokens/GatherBlockQuantized",
    )
    model.graph.insert_before(gather, [reshape, lookup])
    ir.convenience.replace_all_uses_with(gather.outputs[0], lookup.outputs[0])
    model.graph.remove(gather, safe=True)
    if not table.uses():
        model.graph.initializers.pop(table.name)
    return True

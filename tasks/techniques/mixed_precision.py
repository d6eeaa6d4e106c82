"""Accuracy-aware mixed precision for 4-bit exports: which weight matrices stay at 8 bits.

Starting from all-4-bit, every matrix the export quantizes (for the ONNX model builder one MatMulNBits node: a
layer's fused q/k/v, its o_proj, gate, up, down, and the lm_head; for llama.cpp one GGUF tensor) gets two costs on
the calibration split only:
- the loss increase it causes at int4 and at int8, predicted from the diagonal of the empirical Fisher
  information (squared per-window gradients) times the squared rounding error of the simulated grid, the way
  Fisher-weighted mixed-precision methods rank layers;
- the bytes it adds at int8.
The prediction is scaled to the all-int4 loss increase actually measured, then matrices are kept at int8 in order of
loss saved per byte until the predicted perplexity increase fits `target_ppl_increase` or the size budget is spent.
Each plan is measured again on the calibration windows and the search goes on while the measurement misses the
target. By default a plan is measured on the simulated grid in torch (exactly onnxruntime's blockwise rounding); the
llama.cpp step passes a `measure` that quantizes the GGUF with the plan and scores it in llama.cpp itself (its
importance-matrix rounding has no torch twin). The evaluation split is never seen here: the build step receives the
calibration split only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from tasks.schema import Strict

SCALE_BYTES = 4  # the builder's MatMulNBits scales are in the float32 I/O type on CPU
VERIFY_ROUNDS = 8  # measured plans before the search stops adding matrices


class MixedPrecision(Strict):
    """int4 with the weight matrices that cost the most accuracy kept at int8, chosen on the calibration split
    (tasks/techniques/mixed_precision.py): until the calibration perplexity increase fits the target, or the bytes the
    budget allows are spent."""

    target_ppl_increase: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.02  # below the gate's budget
    size_budget: Annotated[float, Field(gt=0.0, le=1.0)] = 0.6  # share of the all-int8 matrices' bytes
    windows: Annotated[int, Field(ge=1, le=4096)] = 16  # calibration windows the search measures on ...
    window_tokens: Annotated[int, Field(ge=16, le=8192)] = 256  # ... of this many tokens
    # each unit's saving at 8 bits: predicted per matrix from the Fisher diagonal, or measured per decoder layer (and
    # the lm_head) on a quarter of the windows: in the engine (`measured`; for ONNX that is the simulated grid, which
    # is its exact twin) or, for llama.cpp, on its torch twin (`simulated`: importance-weighted Q4_0-style scales,
    # the plans still measured in llama.cpp); null: predicted for ONNX, measured for llama.cpp
    sensitivity: Literal["predicted", "measured", "simulated"] | None = None


@dataclass(frozen=True)
class Matrix:
    """One quantized matrix of the export (a MatMulNBits node, a GGUF tensor) and the torch weights it is built from."""

    node: str  # the export's name, e.g. /model/layers.3/attn/qkv_proj/MatMul or blk.3.attn_q.weight
    modules: tuple[str, ...]  # torch module names whose weights it holds (q, k, v are fused into one node)
    parameters: int


@dataclass
class MatrixChoice:
    node: str
    bits: int
    parameters: int
    int4_cost: (
        float  # predicted loss increase (nats/token) at int4, after scaling to the measured all-int4 increase
    )
    int8_cost: float
    extra_bytes: int  # what keeping it at int8 adds


@dataclass
class PrecisionPlan:
    """The search's outcome: the per-matrix bits and the figures it was chosen on (all on calibration windows)."""

    target_ppl_increase: float
    size_budget: float  # share of the all-int8 weight bytes the plan may use
    calibration_tokens: int
    fp32_loss: float
    int4_ppl_increase: float  # measured, every matrix at int4
    predicted_ppl_increase: float  # of the chosen plan
    measured_ppl_increase: float  # of the chosen plan
    size_ratio: float  # the plan's weight bytes / the all-int8 weight bytes (matrices only)
    stopped_by: str  # "target met", "size budget", "no matrix left"
    tied_embeddings: (
        bool  # the lm_head's table is the embedding's (stored once, int4, while the lm_head is int4)
    )
    matrices: list[MatrixChoice] = field(default_factory=list)
    kept_as: str = "int8"  # what the export stores an 8-bit matrix as (llama.cpp: Q8_0)
    sensitivity: str = "predicted"  # each matrix's saving: "predicted" (Fisher) or "measured per layer"

    @property
    def int8_nodes(self) -> list[str]:
        return [m.node for m in self.matrices if m.bits == 8]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tensor_types(self) -> dict[str, str]:
        """llama.cpp: the tensors the plan keeps at 8 bits → their type (the rest keep llama.cpp's own choice for
        the file type: Q4_0 with an importance matrix stores the first layers' ffn_down as Q4_1)."""
        return {m.node: self.kept_as for m in self.matrices if m.bits == 8}

    def builder_options(self) -> dict[str, Any]:
        """`--target_options` of ONNX Runtime GenAI's model builder: these nodes at int8, the rest at int4."""
        return int8_overrides(self.int8_nodes, self.tied_embeddings)

    def note(self) -> str:
        kept = len(self.int8_nodes)
        return (
            f"mixed precision: {kept} of {len(self.matrices)} matrices kept at {self.kept_as} (stopped by "
            f"{self.stopped_by}); "
            f"calibration perplexity +{self.measured_ppl_increase:.1%} measured (+{self.predicted_ppl_increase:.1%} "
            f"predicted, +{self.int4_ppl_increase:.1%} all-int4), {self.size_ratio:.0%} of int8's weight bytes"
        )


def int8_overrides(nodes: list[str], tied: bool) -> dict[str, Any]:
    """The model builder's `--target_options` keeping `nodes` at int8 in an int4 export. op_types are named, or the
    structured config quantizes MatMuls only and an embedding is stored float32; but a tied model's embedding is
    left to the builder's float Gather when its lm_head is int8 (builder 0.18 writes an invalid graph for an int8
    shared table), which tasks/engines/onnx/weights.py then points at the lm_head's int8 table where it can."""
    op_types = ["MatMul"] if tied and "/lm_head/MatMul" in nodes else ["MatMul", "Gather"]
    overrides = [{"match": {"name": node}, "type": "int8"} for node in nodes]
    return {"quant_config": {"weights": {"op_types": op_types, "overrides": overrides}}}


def export_matrices(model: Any) -> list[Matrix]:
    """The MatMulNBits nodes the model builder makes for a Llama-style decoder, in graph order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        raise ValueError(
            f"mixed_precision: supports Llama-style decoders (model.layers[i].self_attn/.mlp), not "
            f"{type(model).__name__}"
        )
    names = {module: name for name, module in model.named_modules()}
    matrices = []

    def add(node: str, modules: list[Any]) -> None:
        parameters = sum(module.weight.numel() for module in modules)
        matrices.append(Matrix(node, tuple(names[module] for module in modules), parameters))

    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"/model/layers.{i}/attn/qkv_proj/MatMul", [attn.q_proj, attn.k_proj, attn.v_proj])
        add(f"/model/layers.{i}/attn/o_proj/MatMul", [attn.o_proj])
        for projection in ("gate_proj", "up_proj", "down_proj"):
            add(f"/model/layers.{i}/mlp/{projection}/MatMul", [getattr(mlp, projection)])
    add("/lm_head/MatMul", [model.lm_head])
    return matrices


def export_layer_of(matrix: Matrix) -> str:
    """The decoder layer (or the lm_head) an ONNX export's node belongs to (/model/layers.3/mlp/down_proj/MatMul →
    layers.3): the unit a measured search keeps at 8 bits."""
    parts = matrix.node.split("/")
    return parts[2] if len(parts) > 2 and parts[1] == "model" and parts[2].startswith("layers.") else parts[1]


def fake_quantize(weight: Any, bits: int, block: int, symmetric: bool) -> Any:
    """`weight` (out × in) rounded to the MatMulNBits grid: blocks of `block` inputs, one scale each (symmetric:
    the largest magnitude maps to the most negative level, as onnxruntime's blockwise quantizer does)."""
    import torch
    import torch.nn.functional as F

    rows, columns = weight.shape
    padded = F.pad(weight.detach().float(), (0, (-columns) % block)).reshape(rows, -1, block)
    if symmetric:
        levels = 2 ** (bits - 1)
        peak = padded.gather(-1, padded.abs().argmax(-1, keepdim=True))
        scale = peak / -levels
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        rounded = (padded / scale).round().clamp(-levels, levels - 1) * scale
    else:
        top = 2**bits - 1
        low, high = padded.amin(-1, keepdim=True).clamp(max=0), padded.amax(-1, keepdim=True).clamp(min=0)
        scale = (high - low) / top
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = (-low / scale).round().clamp(0, top)
        rounded = ((padded / scale).round() + zero).clamp(0, top).sub(zero) * scale
    return rounded.reshape(rows, -1)[:, :columns].to(weight.dtype)


def matrix_bytes(
    parameters: int, bits: int, block: int, symmetric: bool, scale_bytes: int = SCALE_BYTES
) -> int:
    blocks = math.ceil(parameters / block)
    zero_points = 0 if symmetric else math.ceil(blocks * bits / 8)
    return parameters * bits // 8 + blocks * scale_bytes + zero_points

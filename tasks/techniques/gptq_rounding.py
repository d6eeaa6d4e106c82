"""The int4 ONNX export's own rounding, on CPU, on the calibration split: GPTQ and importance-weighted scales.

GPTQ (Frantar et al., 2022) rounds a matrix one input column at a time and spreads each column's rounding error
over the columns not yet rounded, weighted by the inverse Hessian of the layer's inputs (H = XᵀX on calibration
text), so the layer's outputs stay close to the float ones. Each block of 32 inputs gets one symmetric scale:
onnxruntime's own (`absmax`: the largest magnitude at level −8, and that element kept there), or (`weighted`) the
scale that minimises the block's squared error weighted by each input's importance, its mean squared activation
on the calibration split: llama.cpp's importance-matrix search (`make_qx_quants`: 19 candidate grids, each with its
least-squares scale). Rounding to nearest on the weighted scales needs no Hessian. The levels and scales are
written into the exported graph directly (tasks/engines/onnx/weights.py) and read back to check them.

Measured on SmolLM2-135M (evaluation perplexity ÷ fp32, simulated in torch; the export's own figures are in
docs/results.md): round-to-nearest ×1.33; weighted scales ×1.11; GPTQ ×1.14, on weighted scales ×1.09. The tied
lm_head (whose table is also the embedding's) is the other half: at int8 those become ×1.19, ×1.05, ×1.11 and ×1.05.

One calibration pass collects every matrix's H and importance from the float model (not layer by layer on the
already rounded model, as the paper does: one forward instead of one per layer; on SmolLM2 the sequential order
was no better). Each token's input is scaled to unit length before it enters H: the first positions of every
window become attention sinks whose activations are hundreds of times the others', and left as they are they
dominate H, so GPTQ fits the sinks and loses on every other token (on SmolLM2, decoder matrices only: ×1.39
perplexity against round-to-nearest's ×1.37; with unit-length tokens ×1.27). The importance keeps the raw
activations: on SmolLM2 weighting by H's unit-token diagonal instead gave ×1.16, llama.cpp's
importance × sqrt(σ² + w²) ×1.12, the plain mean square ×1.11.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.techniques.calibration import cached_tensors, capture_statistics, mean_square, unit_token_gram

DAMPING = 0.01  # share of the mean Hessian diagonal added to it (the paper's default)
# weighted scales: candidate grids put the block's largest magnitude at −(levels + step) (llama.cpp's make_qx_quants)
SCALE_STEPS = tuple(step / 10 for step in range(-9, 10))


@dataclass(frozen=True)
class BlockwiseInt:
    """A matrix on a symmetric blockwise grid: integer `levels` (rows × columns, in [−2^(bits−1), 2^(bits−1) − 1])
    and one scale per block of `block` input columns (`scales`: rows × blocks); the weight is level × scale."""

    levels: Any
    scales: Any
    block: int

    def dequantized(self) -> Any:
        columns = self.levels.shape[1]
        return self.levels.float() * self.scales.repeat_interleave(self.block, dim=1)[:, :columns]


@dataclass(frozen=True)
class CalibrationInputs:
    """Per module, from one pass over the calibration windows: GPTQ's Hessian (unit-length tokens) and the
    importance of each input column (its mean squared activation: llama.cpp's importance matrix)."""

    hessians: dict[str, Any]
    importance: dict[str, Any]


def calibration_inputs(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    progress: Callable[[int, int], None] | None = None,
    hessians: bool = True,
    importance: bool = True,
) -> CalibrationInputs:
    """What GPTQ and the weighted scales need, from one pass (each only when asked for)."""
    wanted = {"gram": unit_token_gram} if hessians else {}
    wanted |= {"square": mean_square} if importance else {}
    found = capture_statistics(model, modules, windows, wanted, progress)
    means = {kind: {n: value.float() for n, value in f.means().items()} for kind, f in found.items()}
    return CalibrationInputs(means.get("gram", {}), means.get("square", {}))


def hessians(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """XᵀX / tokens of every module's input (each token scaled to unit length) over the calibration windows."""
    return calibration_inputs(model, modules, windows, progress, importance=False).hessians


def weighted_scales(weights: Any, importance: Any, bits: int = 4) -> tuple[Any, Any]:
    """Per block (the last dimension of `weights`), the scale and levels that minimise the importance-weighted
    squared error Σ importance·(w − scale·level)² over llama.cpp's candidate grids: the block's largest magnitude
    at level −(2^(bits−1) + step), the others rounded to nearest, the scale then the least-squares one for those
    levels. Step 0 is round-to-nearest's own levels, so the error is never above round-to-nearest's.
    `importance` broadcasts against `weights` (≥ 0); a block with no importance keeps round-to-nearest."""
    import torch

    levels = 2 ** (bits - 1)
    dtype = weights.dtype
    weights = (
        weights.double()
    )  # the scores are differences of near sums: float32 would pick by rounding noise
    importance = importance.double().expand_as(weights)
    peak = weights.gather(-1, weights.abs().argmax(-1, keepdim=True))
    safe_peak = torch.where(peak == 0, torch.ones_like(peak), peak)
    rtn_scale = safe_peak / -levels
    best_score = torch.full_like(peak, -1.0)
    best_scale, best_levels = rtn_scale, (weights / rtn_scale).round().clamp(-levels, levels - 1)
    for step in SCALE_STEPS:
        candidate = (weights * (-(levels + step) / safe_peak)).round().clamp(-levels, levels - 1)
        along = (importance * weights * candidate).sum(-1, keepdim=True)
        norm = (importance * candidate * candidate).sum(-1, keepdim=True)
        score = torch.where(norm > 0, along * along / norm.clamp(min=1e-30), torch.full_like(norm, -1.0))
        better = score > best_score  # the weighted error is Σ importance·w² − score
        best_score = torch.where(better, score, best_score)
        best_scale = torch.where(better, along / norm.clamp(min=1e-30), best_scale)
        best_levels = torch.where(better, candidate, best_levels)
    return best_scale.squeeze(-1).to(dtype), best_levels.to(dtype)


def gptq_round(
    weight: Any, hessian: Any, bits: int = 4, block: int = 32, importance: Any = None
) -> BlockwiseInt:
    """`weight` (out × in) rounded by GPTQ to the symmetric blockwise grid. Each block's scale is fixed when GPTQ
    reaches it: onnxruntime's own (largest magnitude at level −2^(bits−1), kept there), or with `importance` (one
    value per input column) the importance-weighted search of `weighted_scales` on the block as GPTQ updated it."""
    import torch

    levels = 2 ** (bits - 1)
    w = weight.detach().float().clone()
    rows, columns = w.shape
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += DAMPING * torch.mean(torch.diag(h)) * torch.eye(columns)
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    integers = torch.zeros(rows, columns, dtype=torch.int8)
    scales = torch.zeros(rows, -(-columns // block))
    for start in range(0, columns, block):
        end = min(start + block, columns)
        part, errors = w[:, start:end].clone(), torch.zeros(rows, end - start)
        peak_at = part.abs().argmax(dim=1)
        if importance is None:
            scale = part.gather(1, peak_at[:, None]).squeeze(1) / -levels
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        else:
            scale, _ = weighted_scales(part, importance[start:end].float()[None, :], bits)
        scales[:, start // block] = scale
        inverse = upper[start:end, start:end]
        for i in range(end - start):
            column = part[:, i]
            q = (column / scale).round().clamp(-levels, levels - 1)
            if importance is None:
                q = torch.where(
                    peak_at == i, torch.full_like(q, -levels), q
                )  # the peak fixes the block's scale
            integers[:, start + i] = q.to(torch.int8)
            error = (column - q * scale) / inverse[i, i]
            part[:, i:] -= error[:, None] * inverse[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ upper[start:end, end:]
    return BlockwiseInt(integers, scales, block)


def weighted_round(weight: Any, importance: Any, bits: int = 4, block: int = 32) -> BlockwiseInt:
    """`weight` (out × in) on the symmetric blockwise grid with importance-weighted scales, no GPTQ."""
    import torch
    import torch.nn.functional as F

    rows, columns = weight.shape
    pad = (-columns) % block
    padded = F.pad(weight.detach().float(), (0, pad)).reshape(rows, -1, block)
    column_importance = F.pad(importance.float(), (0, pad)).reshape(1, -1, block)
    scales, levels = weighted_scales(padded, column_importance, bits)
    levels = levels.reshape(rows, -1)[:, :columns].to(torch.int8)
    return BlockwiseInt(levels, scales, block)


def round_matrices(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    block: int,
    rounding: str,
    scales: str,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, BlockwiseInt]:
    """Every module's weight on the int4 grid, from one calibration pass over `windows`: rounding `gptq` or `rtn`
    (to nearest), scales `absmax` (onnxruntime's) or `weighted` (importance-weighted). The model is left as it was.
    A tied lm_head is rounded too: its table is the int4 embedding's, which then gets these rows as well.
    Inside the statistics cache the result is computed once per model, modules, windows and settings (the int4 and
    the mixed-precision exports of one base share it)."""

    def compute() -> dict[str, Any]:
        rounded = _round_matrices(model, modules, windows, block, rounding, scales, progress)
        return {f"{n}\0{part}": getattr(r, part) for n, r in rounded.items() for part in ("levels", "scales")}

    settings = {
        "block": block,
        "rounding": rounding,
        "scales": scales,
        "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),  # this module: every rounding helper
    }
    stored = cached_tensors(model, modules, windows, round_matrices, compute, settings)
    if progress is not None:
        progress(rounding, len(modules), len(modules))
    return {n: BlockwiseInt(stored[f"{n}\0levels"], stored[f"{n}\0scales"], block) for n in modules}


def _round_matrices(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    block: int,
    rounding: str,
    scales: str,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, BlockwiseInt]:
    found = calibration_inputs(
        model,
        modules,
        windows,
        (lambda i, n: progress("calibration", i, n)) if progress else None,
        hessians=rounding == "gptq",
        importance=scales == "weighted",
    )
    rounded = {}
    for i, (name, module) in enumerate(modules.items()):
        if progress is not None:
            progress(rounding, i, len(modules))
        importance = found.importance[name] if scales == "weighted" else None
        if rounding == "gptq":
            rounded[name] = gptq_round(module.weight, found.hessians[name], 4, block, importance)
        else:
            rounded[name] = weighted_round(module.weight, importance, 4, block)
    if progress is not None:
        progress(rounding, len(modules), len(modules))
    return rounded

"""GPTQ onto torchao's int4 grid: calibrated int4 that torchao's own tinygemm kernels run, with no new dependency.

torchao's tinygemm int4 (tile-packed on a CUDA GPU, the CPU's int4 pack on a CPU) quantizes each group of
`group_size` inputs of a row asymmetrically: levels 0…15, scale = (max − min) / 15 and a float zero point from the
group's own minimum and maximum, rounded to nearest when the model is loaded. Here GPTQ (the same algorithm as
`gptq_rounding`, on unit-length-token Hessians from one calibration pass) rounds each matrix onto that grid, taken
from the weights in bfloat16 as torchao takes it, with each group's minimum and maximum kept at levels 0 and 15 so
that the grid torchao derives from the stored weights is the same one. The weights are stored dequantized in
bfloat16 (torchao's own dequantization): torchao's round-to-nearest at load then stores GPTQ's integers.
`tinygemm_levels` reads the integers back the way torchao does, and the build checks every matrix with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.techniques.gptq_rounding import DAMPING

LEVELS = 16  # uint4: 0…15
# torchao's smallest scale: the CPU's int4 pack clamps scales at 1e-6, the CUDA one at bfloat16's smallest normal
CPU_EPS, CUDA_EPS = 1e-6, None
# groups narrower than 16 CPU steps would get another grid on each device: stored as one value (level 0) instead
NARROW_SPAN = LEVELS * CPU_EPS


@dataclass(frozen=True)
class TinygemmRounded:
    """A matrix on torchao's tinygemm grid: GPTQ's `levels` (rows × columns, 0…15) and the bfloat16 `weight` that
    torchao's round-to-nearest turns back into them."""

    levels: Any
    weight: Any


def tinygemm_qparams(weight: Any, group_size: int, eps: float | None = CUDA_EPS) -> tuple[Any, Any]:
    """(scale, zero point) per row and group (rows × groups), as torchao's tinygemm int4 chooses them for this
    bfloat16 weight (`eps`: the device's smallest scale)."""
    import torch
    from torchao.quantization.quant_primitives import MappingType, _choose_qparams_affine_tinygemm

    scale, zero = _choose_qparams_affine_tinygemm(
        weight,
        MappingType.ASYMMETRIC,
        (1, group_size),
        torch.int32,
        0,
        LEVELS - 1,
        eps=eps,
        scale_dtype=torch.bfloat16,
        zero_point_dtype=torch.bfloat16,
    )
    rows = weight.shape[0]
    return scale.reshape(rows, -1), zero.reshape(rows, -1)  # one group a row comes back flat


def tinygemm_levels(weight: Any, group_size: int, eps: float | None = CUDA_EPS) -> Any:
    """The integers torchao's tinygemm int4 stores for this bfloat16 weight (its own qparams and rounding)."""
    import torch
    from torchao.quantization.quant_primitives import _quantize_affine_tinygemm

    scale, zero = tinygemm_qparams(weight, group_size, eps)
    return _quantize_affine_tinygemm(weight, [1, group_size], scale, zero, torch.int32, 0, LEVELS - 1)


def tinygemm_dequantized(levels: Any, weight: Any, group_size: int) -> Any:
    """`levels` on the grid torchao chooses for the bfloat16 `weight`, dequantized as torchao does (bfloat16)."""
    import torch
    from torchao.quantization.quant_primitives import _dequantize_affine_tinygemm

    scale, zero = tinygemm_qparams(weight, group_size)
    return _dequantize_affine_tinygemm(
        levels, [1, group_size], scale, zero, torch.int32, 0, LEVELS - 1, output_dtype=torch.bfloat16
    )


def settled_on_grid(levels: Any, weight: Any, group_size: int, rounds: int = 8) -> Any:
    """`levels` dequantized on the grid of `weight`, then again on the grid torchao derives from the result, until
    the two agree: bfloat16 rounding can move a derived scale by one unit in the last place, and a stored weight
    that is its own grid's dequantization is exactly what the kernel multiplies by."""
    import torch

    stored = tinygemm_dequantized(levels, weight, group_size)
    for _ in range(rounds):
        again = tinygemm_dequantized(levels, stored, group_size)
        if torch.equal(again, stored):
            break
        stored = again
    return stored


def nearest_on_tinygemm(weight: Any, group_size: int) -> TinygemmRounded:
    """`weight` rounded to nearest on torchao's tinygemm grid (what torchao itself does at load), dequantized."""
    import torch

    original = _narrow_groups_flattened(weight.detach().to(torch.bfloat16), group_size)
    levels = tinygemm_levels(original, group_size)
    return TinygemmRounded(levels, settled_on_grid(levels, original, group_size))


def _narrow_groups_flattened(weight: Any, group_size: int) -> Any:
    """Groups whose span is below `NARROW_SPAN` set to their smallest value (a constant group: level 0 on every
    device), so the CPU's and CUDA's torchao read the same integers from the stored weights."""
    rows, columns = weight.shape
    grouped = weight.reshape(rows, -1, group_size)
    low = grouped.amin(dim=2, keepdim=True)
    narrow = (grouped.amax(dim=2, keepdim=True).float() - low.float()) < NARROW_SPAN
    return grouped.where(~narrow, low.expand_as(grouped)).reshape(rows, columns)


def gptq_onto_tinygemm(weight: Any, hessian: Any, group_size: int) -> TinygemmRounded:
    """`weight` (out × in, in a multiple of `group_size`) rounded by GPTQ onto torchao's tinygemm grid of its
    bfloat16 copy, each group's smallest and largest weight pinned at levels 0 and 15 (they fix the grid)."""
    import torch

    original = _narrow_groups_flattened(weight.detach().to(torch.bfloat16), group_size)
    rows, columns = original.shape
    scale, zero = tinygemm_qparams(original, group_size)
    step = scale.float().repeat_interleave(group_size, dim=1)
    low = (zero.float() - scale.float() * (LEVELS // 2)).repeat_interleave(group_size, dim=1)
    grouped = original.float().reshape(rows, -1, group_size)
    # a constant group has no grid (torchao stores level 0 throughout, at the group's value): it stays so
    flat = (grouped.amax(dim=2) == grouped.amin(dim=2)).repeat_interleave(group_size, dim=1)
    pinned_low = _one_hot_columns(grouped.argmin(dim=2), group_size, columns) | flat
    pinned_high = _one_hot_columns(grouped.argmax(dim=2), group_size, columns) & ~flat
    w, upper = original.float().clone(), _inverse_hessian_factor(hessian, original)
    levels = torch.zeros(rows, columns, dtype=torch.int32, device=w.device)
    for start in range(0, columns, group_size):
        end = start + group_size
        part, errors = w[:, start:end].clone(), torch.zeros(rows, group_size, device=w.device)
        inverse = upper[start:end, start:end]
        for i in range(group_size):
            column, at = part[:, i], start + i
            q = ((column - low[:, at]) / step[:, at]).round().clamp(0, LEVELS - 1)
            q = torch.where(pinned_high[:, at], torch.full_like(q, LEVELS - 1), q)
            q = torch.where(pinned_low[:, at], torch.zeros_like(q), q)
            levels[:, at] = q.to(torch.int32)
            error = (column - (low[:, at] + q * step[:, at])) / inverse[i, i]
            part[:, i:] -= error[:, None] * inverse[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ upper[start:end, end:]
    levels, original = levels.cpu(), original.cpu()
    return TinygemmRounded(levels, settled_on_grid(levels, original, group_size))


def _one_hot_columns(positions: Any, group_size: int, columns: int) -> Any:
    """rows × columns booleans, True at each group's position (`positions`: rows × groups, within the group)."""
    import torch

    rows, groups = positions.shape
    marks = torch.zeros(rows, groups, group_size, dtype=torch.bool, device=positions.device)
    marks.scatter_(2, positions[:, :, None], True)
    return marks.reshape(rows, columns)


def _inverse_hessian_factor(hessian: Any, weight: Any) -> Any:
    """GPTQ's upper Cholesky factor of the damped inverse Hessian (dead inputs: unit diagonal)."""
    import torch

    h = hessian.clone().float()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += DAMPING * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], device=h.device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def round_onto_tinygemm(
    model: Any,
    modules: dict[str, Any],
    group_size: int,
    windows: list[list[int]] | None = None,
    progress: Any = None,
) -> dict[str, TinygemmRounded]:
    """Every module's weight on torchao's grid: by GPTQ from one calibration pass over `windows`, or to nearest
    without them; the model is left as it was. Raises when torchao would read other integers back from a stored
    matrix than the ones chosen here."""
    from tasks.errors import BuildError
    from tasks.techniques.calibration import compute_device
    from tasks.techniques.gptq_rounding import hessians

    report = (lambda i, n: progress("calibration", i, n)) if progress else None
    found = hessians(model, modules, windows, report) if windows else {}
    rounded = {}
    for i, (name, module) in enumerate(modules.items()):
        if progress is not None:
            progress("int4 grid", i, len(modules))
        if windows:  # on the calibration device (a cuda target's GPU), back on the CPU after
            device = compute_device()
            result = gptq_onto_tinygemm(module.weight.to(device), found[name].to(device), group_size)
        else:
            result = nearest_on_tinygemm(module.weight, group_size)
        for device, eps in (("cuda", CUDA_EPS), ("cpu", CPU_EPS)):
            differ = int((tinygemm_levels(result.weight, group_size, eps) != result.levels).sum())
            if differ:
                raise BuildError(
                    f"{name}: torchao on {device} would read {differ} of the chosen int4 levels back differently"
                )
        rounded[name] = result
    if progress is not None:
        progress("int4 grid", len(modules), len(modules))
    return rounded

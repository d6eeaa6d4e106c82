"""oneDNN's packed bfloat16 linear maps as the torch engine's slot decoder and the ONNX engine's bfloat16 prompts call
them (`LinearMaps`), the check that this torch and CPU have them right (`packed_linear_works`), and the slot
decoder's CPU cache buffers (`cache_zeros`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tasks.engines.contract import zeroed


class LinearMaps:
    """A decoder layer's (or the head's) linear maps as the step calls them: q, k and v in one call, gate and up in
    one, each the outputs side by side. With `pack` (bfloat16 on a CPU with oneDNN), the maps' weights are joined
    into one matrix in the blocked layout oneDNN's matmul reads fastest, a copy made once per model and kept: plain
    `nn.Linear` weights are re-laid out on every call, which at a few rows costs about a third of the step. Without,
    the model's own weights through `F.linear`, one call per map (no copy)."""

    def __init__(self, linears: list[Any], pack: bool) -> None:
        import torch

        self.sizes = [linear.weight.shape[0] for linear in linears]
        self.packed = pack
        self._linears = [] if pack else list(linears)
        if not pack:
            return
        biases = [linear.bias for linear in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    (b if b is not None else linear.weight.new_zeros(linear.weight.shape[0])).detach()
                    for b, linear in zip(biases, linears, strict=True)
                ]
            )
        )
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 16)

    def __call__(self, x: Any) -> Any:
        """x [tokens, in] -> [tokens, sum of the maps' outputs]."""
        import torch
        import torch.nn.functional as F

        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        outputs = [F.linear(x, linear.weight, linear.bias) for linear in self._linears]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def cache_zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """torch.zeros; on a CPU on regular pages (`zeroed`: no stall for huge pages while clients wait)."""
    import numpy as np
    import torch

    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(zeroed(shape, {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[size])).view(
        dtype
    )


def packed_linear_works(weight: Any) -> bool:
    """Whether oneDNN's packed bfloat16 linear is in this torch and right on this CPU: `weight` (a bfloat16 [out,
    in] matrix) packed and applied to a few seeded rows, against `F.linear`."""
    import torch

    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available():
        return False
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        seeded = torch.Generator().manual_seed(0)  # the process's own random state untouched
        x = torch.randn(3, weight.shape[1], generator=seeded).to(weight.dtype)
        got = LinearMaps([SimpleNamespace(weight=weight.detach(), bias=None)], pack=True)(x)
        return bool(torch.allclose(got, torch.nn.functional.linear(x, weight), rtol=0.02, atol=0.02))
    except RuntimeError:  # an oneDNN build without bfloat16 matmul on this CPU
        return False

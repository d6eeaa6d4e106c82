"""One calibration pass, shared by every technique that measures the model's inputs on the calibration split.

The calibration windows run through the model once with a forward hook on each named module; each call's input
rows (tokens × features) are reduced by a statistic and summed per module. GPTQ's Hessians (XᵀX), llama.cpp's
importance matrix (mean x²) and structured pruning's activation importance (mean |x|) are this one loop with a
different statistic. (optimum-quanto's `Calibration()` keeps its own hooks: it records into quanto's modules.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.errors import BuildError

WINDOW_TOKENS = 256  # tokens per calibration window, for every technique that calibrates


@dataclass(frozen=True)
class InputStatistics:
    """Per module: the statistic summed over every calibration token, and how many tokens that was."""

    sums: dict[str, Any]
    tokens: int

    def means(self) -> dict[str, Any]:
        """Per module: the statistic's mean per token."""
        return {name: total / self.tokens for name, total in self.sums.items()}


def capture_inputs(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    statistic: Callable[[Any], Any],
    progress: Callable[[int, int], None] | None = None,
) -> InputStatistics:
    """Run `windows` through `model` (eval mode, no gradients), summing `statistic(rows)` of each module's input,
    where rows is the input reshaped to (tokens, features); `progress(done, total)` after each window."""
    import torch

    if not windows:
        raise BuildError("the calibration split gave no token windows (it is shorter than 8 tokens)")
    sums: dict[str, Any] = dict.fromkeys(modules, 0)

    def hook(name: str) -> Callable[..., None]:
        def record(_module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
            rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums[name] + statistic(rows)

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    tokens = 0
    try:
        model.eval()
        with torch.no_grad():
            for index, ids in enumerate(windows):
                model(input_ids=torch.tensor([ids], device=model.device))
                tokens += len(ids)
                if progress is not None:
                    progress(index + 1, len(windows))
    finally:
        for handle in handles:
            handle.remove()
    seen = {name: total for name, total in sums.items() if not isinstance(total, int)}  # a module never run
    return InputStatistics(seen, tokens)


def mean_square(rows: Any) -> Any:
    """Each input column's squared activation summed over tokens (llama.cpp's importance matrix), in float64."""
    rows = rows.double()
    return (rows * rows).sum(dim=0)


def mean_absolute(rows: Any) -> Any:
    """Each input column's |activation| summed over tokens (activation importance for structured pruning)."""
    return rows.abs().sum(0)


def unit_token_gram(rows: Any) -> Any:
    """XᵀX in float64 with every token's input scaled to unit length first (GPTQ's Hessian; see gptq_rounding.py why)."""
    rows = rows.double()
    rows = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return rows.T @ rows

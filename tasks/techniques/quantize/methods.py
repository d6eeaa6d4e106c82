"""The quantization-method contract: a `QuantMethod` registered with `register_method` is one `method:` value of
the `quantize` step. It declares what it stores and needs (bits, packages, devices, the CUDA capability of its
kernels), which of the step's settings it reads, its rows in the docs' technique table, and how it quantizes a
float model in memory into a weights format (tasks/weights/) that the torch engine loads.

Adding a method is one module that calls `register_method` (its tests beside), imported by
tasks/techniques/quantize/step.py's `BUILT_IN` or as a plug-in (tasks/plugins.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tasks.techniques.registry import Row


class QuantizeSettings(Protocol):
    """What a method reads of the `quantize` step's settings (tasks.techniques.quantize.step.QuantizeStep)."""

    method: str
    group_size: int
    double_quant: bool
    compute_dtype: str
    bits: int
    desc_act: bool
    calibration_windows: int


@dataclass(frozen=True)
class Quantized:
    """A quantized model in memory, the weights format that saves it, and what that format stores beside it."""

    model: Any
    weights_format: str
    record: dict[str, Any] | None = None


# (model, settings, calibration windows of token ids (empty unless the method calibrates), progress) → Quantized
Quantizer = Callable[[Any, Any, list[list[int]], Any], Quantized]


@dataclass(frozen=True)
class QuantMethod:
    name: str  # the `method:` value
    note: str  # what it stores and runs, for the manifest
    bits: int | None  # bits per weight (None: the `bits` setting says)
    quantize: Quantizer
    packages: tuple[str, ...] = ()  # what a registered variant needs to load it (beyond the serving set)
    devices: tuple[str, ...] = ("cpu", "cuda")  # the target devices its kernels run on
    instead: str = ""  # what to use on a device it does not run on (the pre-flight line's alternative)
    capability: tuple[int, int] | None = None  # the least CUDA compute capability its kernels need
    takes: tuple[str, ...] = ()  # the step's method-specific settings it reads (setting another's is refused)
    calibrates: bool = False  # it reads `calibration_windows` windows of the calibration split
    on_load: str | None = (
        None  # the torchao kernel it is quantized for when loaded (tasks/weights/on_load.py)
    )
    # the settings check beyond ownership: (settings) → a message, or "" when they are fine
    check: Callable[[Any], str] | None = None
    refused: str = ""  # why the target check refuses it on every target llmopt drives (and what to use)
    rows: tuple[Row, ...] = ()  # its rows in the technique table (a family may list several methods in one)


METHODS: dict[str, QuantMethod] = {}


def register_method(method: QuantMethod) -> QuantMethod:
    """Add `method` under its name (a second, different method of the same name is an error)."""
    if method.name in METHODS and METHODS[method.name] != method:
        raise ValueError(f"quantize method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method

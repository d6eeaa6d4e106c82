"""The `quantize` step: one technique whose `method` picks a registered quantization method
(tasks/techniques/quantize/methods.py). Each method family's module registers its methods: importing them here, in
`BUILT_IN` order, is what makes them valid `method:` values (plug-ins add theirs through tasks/plugins.py, loaded
with the techniques).

Each backend library is imported only inside the function that needs it (their imports take 3–6 s). Every method
declares the devices it runs on and the CUDA compute capability its kernels need: the target check refuses the
rest before any work starts."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tasks.schema import Former, Strict
from tasks.techniques.calibration import WINDOW_TOKENS
from tasks.techniques.quantize.methods import METHODS, Quantized
from tasks.techniques.registry import Applied, ConfigView, Row, Technique, register, step_arguments

if TYPE_CHECKING:
    from tasks.engines.manifest import VariantManifest

# The built-in method families (modules under tasks.techniques.quantize), imported in this order, which is the
# order their methods are listed in (messages, the docs table).
BUILT_IN = ("torch_dynamic", "torchao", "quanto", "bitsandbytes", "gptq_grid", "gptqmodel")
for _family in BUILT_IN:
    importlib.import_module(f"tasks.techniques.quantize.{_family}")


class QuantizeStep(Strict):
    """Weight quantization; see tasks/techniques/quantize/ for what each method stores and runs."""

    # gptqmodel was `gptq`, which read as llmopt's own GPTQ rounding (onnx_genai rounding: gptq)
    FORMER: ClassVar[dict[str, Former]] = {"method": Former("method", {"gptq": "gptqmodel"})}
    method: str  # a registered method's name
    # Method-specific settings; setting one that another method owns is refused.
    # int4 methods' group of inputs per scale (SmolLM2's 576 = 9 × 64; tinygemm takes 32, 64 or 128)
    group_size: Literal[32, 64, 128, 192] = 64
    double_quant: bool = True  # bnb_nf4 / bnb_fp4: also quantize the scales
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # bnb_nf4 / bnb_fp4 matmuls
    bits: Literal[2, 3, 4, 8] = 4  # gptqmodel
    desc_act: bool = False  # gptqmodel: quantize columns by decreasing activation order
    # quanto_w8a8, torchao_int4_gptq: calibration windows (of 256 tokens) its scales / Hessians are set on
    calibration_windows: Annotated[int, Field(ge=1, le=4096)] = 16

    @field_validator("method")
    @classmethod
    def _a_registered_method(cls, method: str) -> str:
        if method not in METHODS:
            names = [repr(name) for name in METHODS]
            expected = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return method

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> QuantizeStep:
        for name in sorted(self.model_fields_set - {"method"}):  # every other setting is some method's
            owners = [method.name for method in METHODS.values() if name in method.takes]
            if self.method not in owners:
                raise ValueError(f"{name} applies to {' / '.join(owners)}, not {self.method}")
        check = METHODS[self.method].check
        problem = check(self) if check else ""
        if problem:
            raise ValueError(problem)
        return self


@register
class Quantize(Technique):
    name = "quantize"
    settings = QuantizeStep
    role = "quantize"

    def apply(self, model: Any, settings: QuantizeStep, context: Any) -> Applied:
        method = METHODS[settings.method]
        calibration = (
            context.sequences(context.tokenizer, WINDOW_TOKENS, limit=settings.calibration_windows)
            if method.calibrates
            else []
        )
        with step_arguments(self.name):
            done = quantize_model(model, settings, calibration, context.report)
        return Applied(done.model, done.weights_format, method.note, done.record)

    def weight_bits(self, settings: QuantizeStep, manifest: VariantManifest) -> int | None:
        return METHODS[settings.method].bits or settings.bits

    def packages(self, settings: QuantizeStep) -> list[str]:
        return list(METHODS[settings.method].packages)

    def problems(
        self, where: str, settings: QuantizeStep, config: ConfigView, cuda_available: bool
    ) -> list[str]:
        from tasks.measure.fingerprint import cuda_capability

        method, device = METHODS[settings.method], config.target.device
        if device.partition(":")[0] not in method.devices:
            return [f"{where}.method: {settings.method} does not run on {device}: {method.instead}"]
        if method.refused:
            return [f"{where}.method: {method.refused}"]
        if settings.compute_dtype == "float16" and not config.target.is_cuda:
            return [
                f"{where}.compute_dtype: float16 has no fast matmul kernels on a cpu target; use bfloat16"
            ]
        have = cuda_capability(device) if config.target.is_cuda and cuda_available else None
        if method.capability and have and have < method.capability:
            need = ".".join(map(str, method.capability))
            return [
                f"{where}.method: {settings.method} needs a GPU of compute capability {need} or more, "
                f"{device} has {have[0]}.{have[1]}; use torchao_int8_weight_only"
            ]
        return []

    def rows(self) -> list[Row]:
        return [row for method in METHODS.values() for row in method.rows]


def quantize_model(
    model: Any, settings: QuantizeStep, calibration: list[list[int]], progress: Any = None
) -> Quantized:
    """Quantize a float model in memory with the registered method `settings.method` names."""
    return METHODS[settings.method].quantize(model, settings, calibration, progress)

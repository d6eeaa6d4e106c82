"""quantize: weight quantization backends behind one step (torch, torchao, optimum-quanto, bitsandbytes).

Each backend is imported only inside the function that needs it (their imports take 3–6 s). Artifacts use the
library's own serialization (loaded back by `tasks.engines.torch_weights`): torchao and bitsandbytes through
transformers (`quantization_config` in config.json, reloaded by `from_pretrained`), quanto as its state dict plus
`quantization_map.json` (reloaded by `requantize`). torchao's tinygemm int4 and FP8 kernels pack weights for the
device they run on, so those methods store bfloat16 weights on their grid and are quantized when loaded there
(`hf-quantize-on-load`); `torchao_int4_gptq` puts GPTQ's levels on that grid (tasks/techniques/tinygemm_rounding.py).
Every method declares the devices it runs on and the CUDA compute capability its kernels need: the target check
refuses the rest before any work starts. gptqmodel needs its CUDA kernels, which have no wheel.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.schema import Former, Strict
from tasks.techniques.calibration import WINDOW_TOKENS
from tasks.techniques.registry import Applied, ConfigView, Row, Technique, register, step_arguments

if TYPE_CHECKING:
    from tasks.engines.manifest import VariantManifest


@dataclass(frozen=True)
class Method:
    note: str  # what it stores and runs, for the manifest and the technique table
    bits: int | None  # bits per weight (None: the `bits` setting says)
    packages: tuple[str, ...] = ()  # what a registered variant needs to load it (beyond the serving set)
    devices: tuple[str, ...] = ("cpu", "cuda")  # the target devices its kernels run on
    instead: str = ""  # what to use on a device it does not run on (the pre-flight line's alternative)
    capability: tuple[int, int] | None = None  # the least CUDA compute capability its kernels need
    on_load: str | None = (
        None  # the torchao kernel it is quantized for when loaded (tasks.engines.torch_weights)
    )


TINYGEMM = ("accelerate", "torchao")


METHODS = {
    "torch_dynamic_int8": Method(
        "int8 per-channel weights, int8 activations quantized per batch (W8A8 dynamic)",
        8,
        devices=("cpu",),
        instead="torch's dynamic int8 kernels are CPU-only (fbgemm/onednn); on cuda use torchao_int8_dynamic",
    ),
    "torchao_int8_weight_only": Method(
        "torchao int8 per-channel weights, float activations (W8A16)", 8, ("accelerate", "torchao")
    ),
    "torchao_int8_dynamic": Method(
        "torchao int8 weights + int8 activations quantized per token at run time (W8A8)",
        8,
        ("accelerate", "torchao"),
    ),
    "torchao_int4_weight_only": Method(
        "torchao int4 weights in groups (IntxWeightOnly; stored one int4 per int8 byte)",
        4,
        ("accelerate", "torchao"),
    ),
    "quanto_w8a16": Method("optimum-quanto int8 weights, float activations", 8, ("optimum-quanto",)),
    "quanto_w4a16": Method(
        "optimum-quanto int4 weights (groups of 64), float activations", 4, ("optimum-quanto",)
    ),
    "quanto_w8a8": Method(
        "optimum-quanto int8 weights + int8 activations with scales calibrated on the calibration split "
        "(lm_head kept float: its activations do not survive int8)",
        8,
        ("optimum-quanto",),
    ),
    "bnb_nf4": Method("bitsandbytes 4-bit NormalFloat weights", 4, ("accelerate", "bitsandbytes")),
    "bnb_fp4": Method("bitsandbytes 4-bit float weights", 4, ("accelerate", "bitsandbytes")),
    "bnb_int8": Method(
        "bitsandbytes LLM.int8() (int8 weights, outlier features in 16-bit)",
        8,
        ("accelerate", "bitsandbytes"),
    ),
    "torchao_int4_tinygemm": Method(
        "torchao int4 in groups, asymmetric with a float zero point, rounded to nearest (tinygemm: tile-packed on a "
        "CUDA GPU, the CPU's int4 pack on a CPU), bfloat16 activations; stored as bfloat16 on the grid, packed "
        "when loaded",
        4,
        TINYGEMM,
        capability=(8, 0),
        on_load="tinygemm_int4",
    ),
    "torchao_int4_gptq": Method(
        "GPTQ on the calibration split onto torchao's tinygemm int4 grid (torchao's rounding at load keeps "
        "GPTQ's integers), bfloat16 activations; stored as bfloat16 on the grid, packed when loaded",
        4,
        TINYGEMM,
        capability=(8, 0),
        on_load="tinygemm_int4",
    ),
    "torchao_fp8_per_row": Method(
        "torchao FP8 (e4m3) weights and activations, one scale per row / token (W8A8-FP8), bfloat16 elsewhere; "
        "stored as bfloat16, quantized when loaded",
        8,
        TINYGEMM,
        devices=("cuda",),
        instead="FP8 matmuls need a GPU of compute capability 8.9 or more; on cpu use torchao_int8_dynamic",
        capability=(8, 9),
        on_load="fp8_per_row",
    ),
    "gptqmodel": Method(
        "gptqmodel's GPTQ (CUDA only)",
        None,
        ("gptqmodel",),
        devices=("cuda",),
        instead="gptqmodel's kernels and calibration are CUDA-only (its sdist does not build here); use "
        "onnx_genai int4 or quanto_w4a16 on cpu",
    ),
}
NOTES = {name: method.note for name, method in METHODS.items()}

QuantizeMethod = Literal[tuple(METHODS)]  # type: ignore[valid-type]


class QuantizeStep(Strict):
    """Weight quantization; see tasks/techniques/quantize.py for what each method stores and runs."""

    # gptqmodel was `gptq`, which read as llmopt's own GPTQ rounding (onnx_genai rounding: gptq)
    FORMER: ClassVar[dict[str, Former]] = {"method": Former("method", {"gptq": "gptqmodel"})}
    method: QuantizeMethod
    # Method-specific settings; setting one that another method owns is refused.
    # int4 methods' group of inputs per scale (SmolLM2's 576 = 9 × 64; tinygemm takes 32, 64 or 128)
    group_size: Literal[32, 64, 128, 192] = 64
    double_quant: bool = True  # bnb_nf4 / bnb_fp4: also quantize the scales
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # bnb_nf4 / bnb_fp4 matmuls
    bits: Literal[2, 3, 4, 8] = 4  # gptqmodel
    desc_act: bool = False  # gptqmodel: quantize columns by decreasing activation order
    # quanto_w8a8, torchao_int4_gptq: calibration windows (of 256 tokens) its scales / Hessians are set on
    calibration_windows: Annotated[int, Field(ge=1, le=4096)] = 16

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> QuantizeStep:
        owners = {
            "group_size": (
                "torchao_int4_weight_only",
                "torchao_int4_tinygemm",
                "torchao_int4_gptq",
                "gptqmodel",
            ),
            "double_quant": ("bnb_nf4", "bnb_fp4"),
            "compute_dtype": ("bnb_nf4", "bnb_fp4"),
            "bits": ("gptqmodel",),
            "desc_act": ("gptqmodel",),
            "calibration_windows": ("quanto_w8a8", "torchao_int4_gptq"),
        }
        for name in sorted(name for name in owners if name in self.model_fields_set):
            if self.method not in owners[name]:
                raise ValueError(f"{name} applies to {' / '.join(owners[name])}, not {self.method}")
        if METHODS[self.method].on_load == "tinygemm_int4" and self.group_size not in (32, 64, 128):
            raise ValueError(
                f"group_size: torchao's tinygemm int4 takes 32, 64 or 128, not {self.group_size}"
            )
        return self


@register
class Quantize(Technique):
    name = "quantize"
    settings = QuantizeStep
    role = "quantize"

    def apply(self, model: Any, settings: QuantizeStep, context: Any) -> Applied:

        calibration = (
            context.sequences(context.tokenizer, WINDOW_TOKENS, limit=settings.calibration_windows)
            if settings.method in ("quanto_w8a8", "torchao_int4_gptq")
            else []
        )
        with step_arguments(self.name):
            model, weights_format = quantize_model(model, settings, calibration, context.report)
        record = on_load_record(settings) if METHODS[settings.method].on_load else None
        return Applied(model, weights_format, NOTES[settings.method], record)

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
        if settings.method == "gptqmodel":
            return [
                f"{where}.method: gptqmodel is not driven by llmopt (it has no wheel here; its CUDA kernels build at "
                "install); use torchao_int4_gptq (llmopt's GPTQ onto torchao's int4 kernels)"
            ]
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
        return [
            Row(
                "`quantize: {method: torch_dynamic_int8}`",
                (),
                "per-channel int8 weights, int8 activations per batch, every `nn.Linear` (PyTorch dynamic "
                "quantization)",
            ),
            Row(
                "`quantize: {method: torchao_int8_weight_only \\| torchao_int8_dynamic}`",
                (),
                "torchao W8A16 / W8A8 (per-token dynamic activations), saved and reloaded through transformers' "
                "`TorchAoConfig`",
            ),
            Row(
                "`quantize: {method: torchao_int4_weight_only}`",
                ("group_size",),
                "torchao int4 in groups (`IntxWeightOnlyConfig`); stored one int4 per byte, so **no smaller on "
                "disk**",
            ),
            Row(
                "`quantize: {method: quanto_w8a16 \\| quanto_w4a16 \\| quanto_w8a8}`",
                ("calibration_windows",),
                "optimum-quanto; W8A8 calibrates activation scales on `calibration_windows` windows of the "
                "calibration split, `lm_head` kept "
                "float; saved as quanto's state dict + `quantization_map.json`",
            ),
            Row(
                "`quantize: {method: bnb_nf4 \\| bnb_fp4}`",
                ("double_quant", "compute_dtype"),
                "bitsandbytes 4-bit (CPU backend), saved through transformers",
            ),
            Row("`quantize: {method: bnb_int8}`", (), "bitsandbytes LLM.int8()"),
            Row(
                "`quantize: {method: torchao_int4_tinygemm}`",
                ("group_size",),
                "torchao's tinygemm int4 (asymmetric groups, float zero point; bfloat16 activations): tile-packed "
                "kernels on a CUDA GPU (compute capability 8.0+), the CPU's int4 kernel on a CPU. Stored as "
                "bfloat16 on the grid and packed when loaded, so **no smaller on disk**",
            ),
            Row(
                "`quantize: {method: torchao_int4_gptq}`",
                ("group_size", "calibration_windows"),
                "GPTQ on the calibration split onto the same tinygemm grid: torchao's rounding at load stores "
                "GPTQ's integers (checked for every matrix at build)",
            ),
            Row(
                "`quantize: {method: torchao_fp8_per_row}`",
                (),
                "**GPU targets, compute capability 8.9+**: torchao FP8 weights and activations, one scale per "
                "row / token; quantized when loaded",
            ),
            Row(
                "`quantize: {method: gptqmodel}`",
                ("bits", "group_size", "desc_act"),
                "**GPU targets only**: gptqmodel's kernels and calibration need CUDA (its sdist does not build "
                "here); refused on `target.device: cpu` before any work",
            ),
        ]


def quantize_model(
    model: Any, step: QuantizeStep, calibration: list[list[int]], progress: Any = None
) -> tuple[Any, str]:
    """Quantize a float model in memory; returns (model, weights format). Methods quantized when loaded return
    the model with its weights put on their grid (GPTQ) or as they were (round-to-nearest at load)."""
    from tasks.engines.torch_weights import (
        ON_LOAD,
        QUANTO,
        TORCH_DYNAMIC,
        TRANSFORMERS_QUANTIZED,
        on_load_modules,
        quantize_dynamic_int8,
    )

    if METHODS[step.method].on_load:
        if METHODS[step.method].on_load == "tinygemm_int4":
            round_onto_torchao_grid(model, step, calibration, progress)
        else:
            refuse_unquantized_decoder_matrices(model, on_load_modules(model, on_load_record(step)), step)
        return model, ON_LOAD
    if step.method == "torch_dynamic_int8":
        return quantize_dynamic_int8(model), TORCH_DYNAMIC
    if step.method.startswith("quanto_"):
        return quantize_quanto(model, step, calibration), QUANTO
    if step.method.startswith(("torchao_", "bnb_")):
        return quantize_at_load(model, transformers_quantization_config(step)), TRANSFORMERS_QUANTIZED
    raise ValueError(
        f"method: {step.method} cannot run on this target"
    )  # gptqmodel: refused by the target check


def transformers_quantization_config(step: QuantizeStep) -> Any:
    """The transformers `quantization_config` of a torchao or bitsandbytes method."""
    import torch

    if step.method.startswith("bnb_"):
        from transformers import BitsAndBytesConfig

        if step.method == "bnb_int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=step.method.removeprefix("bnb_"),
            bnb_4bit_use_double_quant=step.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, step.compute_dtype),
        )
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    configs = {
        "torchao_int8_weight_only": Int8WeightOnlyConfig,
        "torchao_int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "torchao_int4_weight_only": lambda: IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(step.group_size)
        ),
    }
    return TorchAoConfig(configs[step.method]())


def on_load_record(step: QuantizeStep) -> dict[str, Any]:
    """What `quantize-on-load.json` says: the torchao kernel, its group size, the method that wrote it."""
    kernel = METHODS[step.method].on_load
    group = {"group_size": step.group_size} if kernel == "tinygemm_int4" else {}
    return {"kernel": kernel, "method": step.method, **group}


def round_onto_torchao_grid(
    model: Any, step: QuantizeStep, calibration: list[list[int]], progress: Any = None
) -> None:
    """Put the weights torchao quantizes at load on its tinygemm grid, in place: GPTQ's levels
    (torchao_int4_gptq) or round-to-nearest's, so the stored bfloat16 weights are exactly what the kernel runs."""
    import torch

    from tasks.engines.torch_weights import on_load_modules
    from tasks.techniques.tinygemm_rounding import round_onto_tinygemm

    gptq = step.method == "torchao_int4_gptq"
    if gptq and not calibration:
        raise ValueError("method: torchao_int4_gptq calibrates on the calibration split, which is empty")
    modules = on_load_modules(model, on_load_record(step))
    refuse_unquantized_decoder_matrices(model, modules, step)
    rounded = round_onto_tinygemm(model, modules, step.group_size, calibration if gptq else None, progress)
    with torch.no_grad():
        for name, result in rounded.items():
            modules[name].weight.copy_(result.weight.float())


def refuse_unquantized_decoder_matrices(model: Any, chosen: dict[str, Any], step: QuantizeStep) -> None:
    """A decoder matrix torchao would leave in bfloat16 (its inputs do not split into whole groups, or its outputs
    are not a multiple of 16) is refused, naming it: the variant would be reported as 4-bit and not be."""
    import torch

    left = [
        f"{name} ({module.out_features}×{module.in_features})"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and name not in chosen
    ]
    if left:
        group = f"group_size: {step.group_size}" if METHODS[step.method].on_load == "tinygemm_int4" else "FP8"
        raise ValueError(
            f"method: {step.method}: {group} leaves {len(left)} decoder matrices unquantized (e.g. {left[0]}: "
            "inputs must split into whole groups, outputs be a multiple of 16); choose a group that divides them"
        )


def quantize_at_load(model: Any, quantization_config: Any) -> Any:
    """Save the float model and reload it with `quantization_config`: how transformers applies these backends."""
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="llmopt-quantize-") as scratch:
        model.save_pretrained(scratch)
        return AutoModelForCausalLM.from_pretrained(
            scratch, quantization_config=quantization_config, dtype=torch.float32
        )


def quantize_quanto(model: Any, step: QuantizeStep, calibration: list[list[int]]) -> Any:
    """optimum-quanto weights (and, for w8a8, activations calibrated on `calibration`), frozen to packed tensors."""
    import torch
    from optimum.quanto import Calibration, freeze, qint4, qint8, quantize

    weights = qint4 if step.method == "quanto_w4a16" else qint8
    if step.method != "quanto_w8a8":
        quantize(model, weights=weights)
    else:
        quantize(model, weights=weights, activations=qint8, exclude="lm_head")
        if not calibration:
            raise ValueError("method: quanto_w8a8 calibrates on the calibration split, which is empty")
        with torch.no_grad(), Calibration():
            for ids in calibration:
                model(input_ids=torch.tensor([ids]))
    freeze(model)
    return model


def save_quantized(model: Any, weights_format: str, dest: Path, record: dict[str, Any] | None = None) -> None:
    """Write the quantized model with its backend's serialization (config and generation config included);
    `record`: an on-load method's `on_load_record`."""
    import torch

    from tasks.engines.torch_weights import (
        ON_LOAD,
        ON_LOAD_FILE,
        QUANTO_MAP_FILE,
        TORCH_DYNAMIC,
        TORCH_DYNAMIC_FILE,
        TRANSFORMERS_QUANTIZED,
    )

    if weights_format == TRANSFORMERS_QUANTIZED:
        model.save_pretrained(dest)
        return
    if weights_format == ON_LOAD:
        if record is None:
            raise ValueError("an on-load variant needs its quantize step's record")
        model.to(torch.bfloat16).save_pretrained(dest)  # exact: the grid was taken from the bfloat16 weights
        (dest / ON_LOAD_FILE).write_text(json.dumps({**record, **packed_bytes(model, record)}, indent=1))
        return
    model.config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    if weights_format == TORCH_DYNAMIC:
        torch.save(model.state_dict(), dest / TORCH_DYNAMIC_FILE)
        return
    from optimum.quanto import quantization_map
    from safetensors.torch import save_file

    state = model.state_dict()
    head, embeddings = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and embeddings is not None and head.data_ptr() == embeddings.data_ptr():
        del state[
            "lm_head.weight"
        ]  # tied (left float): safetensors refuses shared tensors; re-tied when loaded
    save_file(state, dest / "model.safetensors")
    (dest / QUANTO_MAP_FILE).write_text(json.dumps(quantization_map(model), indent=1, sort_keys=True))


def packed_bytes(model: Any, record: dict[str, Any]) -> dict[str, Any]:
    """Per device kind, the bytes each stored tensor takes once torchao has packed it there, keyed by the stored
    tensor's name, for the roofline (tensors left in bfloat16 keep their stored size). int4: half a byte a weight
    plus a bfloat16 scale and zero point per group, on CUDA of the matrix padded to inputs in multiples of 1024 and
    outputs in multiples of 8 (the tile-packed kernel reads the padding too); FP8: a byte a weight plus a float32
    scale per row."""
    from tasks.engines.torch_weights import ON_LOAD_KERNELS, on_load_modules

    def size(rows: int, columns: int, device: str) -> int:
        if record["kernel"] == "fp8_per_row":
            return rows * columns + rows * 4
        if device == "cuda":
            rows, columns = -(-rows // 8) * 8, -(-columns // 1024) * 1024
        return rows * columns // 2 + rows * (columns // record["group_size"]) * 4

    modules = on_load_modules(model, record)
    return {
        "packed_bytes": {
            device: {f"{name}.weight": size(*module.weight.shape, device) for name, module in modules.items()}
            for device in ON_LOAD_KERNELS[record["kernel"]]
        }
    }

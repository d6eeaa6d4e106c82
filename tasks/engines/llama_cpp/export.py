"""llama_cpp step: the technique (settings, export, report bits, target checks) over tasks/engines/llama_cpp/gguf.py's
converter, quantizer and importance matrix; the variant then runs in llama.cpp (tasks/engines/llama_cpp/runtime.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.engines.llama_cpp import gguf
from tasks.errors import BuildError, LlmoptError
from tasks.schema import Strict
from tasks.techniques.calibration import WINDOW_TOKENS
from tasks.techniques.mixed_precision import MixedPrecision
from tasks.techniques.registry import (
    ConfigView,
    Exported,
    ExportJob,
    Row,
    Technique,
    register,
    save_float_model,
    step_arguments,
)

if TYPE_CHECKING:
    from tasks.engines.manifest import VariantManifest

GgufType = Literal[
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS", "shipped"
]


class LlamaCppStep(Strict):
    """Convert to GGUF with llama.cpp's converter and quantize with llama.cpp (tasks/engines/llama_cpp/gguf.py); the variant
    then runs in llama.cpp. `shipped`: the source model's own GGUF as distributed, unchanged: the peer row, which
    shows what a user gets without llmopt and is measured but never selected."""

    RECORDED_DEFAULTS = frozenset({"type"})
    type: GgufType = "Q4_K_M"  # llama.cpp's file types (K-quant mixes keep sensitive tensors at more bits)
    # an importance matrix (mean squared activation of every input column) measured on the calibration split:
    # the quantizer then rounds to protect the columns that matter (K-quants, Q4_0 and IQ4 types use it)
    imatrix: bool = False
    imatrix_windows: Annotated[int, Field(ge=1, le=4096)] = 32  # calibration windows of 256 tokens it sees
    # Q4_0 / IQ4_NL only: the layers' matrices that cost the most accuracy kept at Q8_0, each plan measured in
    # llama.cpp on the calibration split (tasks/techniques/mixed_precision.py)
    mixed_precision: MixedPrecision | None = None

    MIXABLE: ClassVar[tuple[str, ...]] = ("Q4_0", "IQ4_NL")  # one block-32 type for every matrix

    @model_validator(mode="after")
    def _shipped_is_as_is(self) -> LlamaCppStep:
        if (
            self.type == "shipped"
            and {"imatrix", "imatrix_windows", "mixed_precision"} & self.model_fields_set
        ):
            raise ValueError(
                "type shipped is the source's GGUF unchanged; imatrix and mixed_precision do not apply"
            )
        if "imatrix_windows" in self.model_fields_set and not self.imatrix:
            raise ValueError("imatrix_windows applies only with imatrix: true")
        if self.mixed_precision is not None and self.mixed_precision.sensitivity == "predicted":
            raise ValueError(
                "mixed_precision.sensitivity: llama.cpp's plans are measured per layer, in llama.cpp (measured) or on "
                "its torch twin (simulated); the Fisher prediction ranked the wrong matrices for it"
            )
        if (
            self.mixed_precision is not None
            and self.mixed_precision.sensitivity == "simulated"
            and (self.type != "Q4_0" or not self.imatrix)
        ):
            raise ValueError(
                "mixed_precision.sensitivity: simulated has a torch twin for type Q4_0 with imatrix: true only"
            )
        if self.mixed_precision is not None and self.type not in self.MIXABLE:
            raise ValueError(
                f"mixed_precision applies to type {' or '.join(self.MIXABLE)} (one 4-bit type for every matrix, "
                f"some kept at Q8_0), not {self.type}"
            )
        return self


# nominal bits per weight of each file type (the report's weight_bits)
TYPE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q6_K": 6, "Q5_K_M": 5}
TYPE_BITS |= dict.fromkeys(("Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS"), 4)


@register
class LlamaCpp(Technique):
    name = "llama_cpp"
    settings = LlamaCppStep
    role = "export"
    engine_label = "llama.cpp"
    peer_note = "type shipped is the source's own GGUF"

    def needs_model(self, settings: LlamaCppStep) -> bool:
        return settings.type != "shipped"  # the source's own file, copied as is

    def export(self, model: Any, settings: LlamaCppStep, job: ExportJob) -> Exported:
        from tasks.engines.llama_cpp import runtime as llama_cpp

        if settings.type == "shipped":
            note, parameters = _shipped(job.dest, job.context)
            return Exported(llama_cpp.GGUF, llama_cpp.ENGINE, [note], parameters)
        note = _gguf_export(model, settings, job.base_path, job.dest, job.context, job.changed)
        return Exported(llama_cpp.GGUF, llama_cpp.ENGINE, [note])

    def weight_bits(self, settings: LlamaCppStep, manifest: VariantManifest) -> int | None:
        # nominal bits of the file type; the shipped file: bits per weight on disk
        shipped = round(manifest.size_bytes * 8 / max(manifest.parameters, 1), 1)
        return TYPE_BITS.get(settings.type, shipped)

    def packages(self, settings: LlamaCppStep) -> list[str]:
        return ["llama-cpp-python"]  # no wheel on PyPI for most platforms: pip builds llama.cpp (minutes)

    def problems(
        self, where: str, settings: LlamaCppStep, config: ConfigView, cuda_available: bool
    ) -> list[str]:
        import importlib.util

        problems = []
        if config.target.is_cuda:
            problems.append(
                f"{where}: llama.cpp is built for the CPU here (no CUDA backend); on {config.target.device} use "
                "torch variants (runtime.dtype bfloat16 or float16)"
            )
        if importlib.util.find_spec("llama_cpp") is None:
            problems.append(
                f"{where}: needs llama-cpp-python, which is not installed; run `make install` (it builds "
                "llama.cpp once per machine, ~5 min on 2 cores)"
            )
        if settings.type == "shipped":
            try:
                gguf.shipped_gguf(config.model.source)
            except ValueError as exc:
                problems.append(f"{where}.{exc}")
            except LlmoptError:
                pass  # the model source itself is missing: pre-flight's model check names it
        return problems

    def rows(self) -> list[Row]:
        types = " \\| ".join(t for t in gguf.FILE_TYPES)
        mixed = tuple(f"mixed_precision.{name}" for name in MixedPrecision.model_fields)
        return [
            Row(
                f"`llama_cpp: {{type: {types}}}`",
                ("type", "imatrix", "imatrix_windows"),
                "llama.cpp: the float folder (base, pruned or distilled) goes through llama.cpp's own "
                "`convert_hf_to_gguf.py` to an F32 GGUF, then `llama_model_quantize` to the file type; the variant "
                "runs in llama.cpp (`tasks/engines/llama_cpp/runtime.py`: scoring from llama.cpp's logits, several "
                "sequences per `llama_decode` for batched generation and serving). `imatrix: true`: an importance "
                "matrix (every weight column's mean squared input activation, what `llama-imatrix` measures) from "
                "that many 256-token calibration windows, handed to the quantizer, which then rounds to protect the "
                "columns that matter. Tested: F32 scores like PyTorch fp32 within 1e-3, greedy output identical, "
                "batched = one by one",
            ),
            Row(
                "`llama_cpp: {type: Q4_0 \\| IQ4_NL, mixed_precision: {…}}`",
                mixed,
                "llama.cpp mixed precision: starting from the 4-bit file type as llama.cpp stores it (with an "
                "importance matrix, Q4_0 keeps the first eighth of the layers' `ffn_down` at Q4_1), whole layers "
                "are kept at Q8_0; a budget with no room for one layer is refused before anything is measured. "
                "Each layer's saving is **measured in llama.cpp** (the GGUF quantized with that layer at Q8_0 via "
                "the quantizer's per-tensor overrides, scored on a quarter of the calibration windows), then layers "
                "are added in order of saving per byte and every plan is measured on all calibration windows, until "
                "the increase fits the target or `size_budget` (share of all-Q8_0 matrix bytes) is spent. The "
                "diagonal-Fisher prediction the ONNX search uses ranked the wrong matrices here: with an importance "
                "matrix llama.cpp's rounding is not the simulated grid's. The plan is in the manifest, MLflow "
                "(`mixed_precision.json`, its plot) and checked against the GGUF's tensor types. 4–7 min for "
                "SmolLM2 on 2 cores",
            ),
            Row(
                "`llama_cpp: {type: shipped}`",
                (),
                "the **peer row**: the source model's own GGUF as distributed (the embedded SmolLM2's Q4_1, or the "
                "one `.gguf` in a local source folder), copied unchanged and run by llama.cpp. It shows what a user "
                "gets without llmopt, in the same run; it is measured and ranked but never selected, registered or "
                "promoted",
            ),
        ]


def _gguf_export(
    model: Any, step: LlamaCppStep, base_path: Path, dest: Path, context: Any, changed: bool
) -> str:
    """The model as a llama.cpp GGUF of `step.type` in `dest`."""
    import shutil
    import tempfile

    from tasks.engines.llama_cpp import runtime as llama_cpp

    with tempfile.TemporaryDirectory(prefix="llmopt-gguf-") as scratch:
        source = save_float_model(model, context.tokenizer, Path(scratch)) if changed else base_path
        f32 = Path(scratch) / "model-f32.gguf"
        caveat = gguf.convert_to_gguf(source, f32)
        imatrix, note = None, f"llama.cpp {step.type}"
        if step.imatrix:
            windows = context.sequences(context.tokenizer, WINDOW_TOKENS, limit=step.imatrix_windows)
            imatrix = gguf.importance_matrix(model, windows, context.report)
            note += f", importance matrix of {len(imatrix)} tensors from {sum(map(len, windows)):,} calibration tokens"
        types = None
        if step.mixed_precision:
            plan = _precision_plan(model, step, f32, imatrix, context)
            types = plan.tensor_types()
            context.mixed_precision = plan.to_dict()
            note += f"; {plan.note()}"
        if step.type == "F32":
            shutil.move(f32, dest / llama_cpp.MODEL_FILE)
        else:
            gguf.quantize_gguf(f32, dest / llama_cpp.MODEL_FILE, step.type, imatrix, tensor_types=types)
        if types:
            stored = gguf.tensor_types(dest / llama_cpp.MODEL_FILE)
            wrong = {name: stored.get(name) for name, kind in types.items() if stored.get(name) != kind}
            if wrong:  # a kept tensor llama.cpp could not store as planned (its shape fits no block) is named
                raise BuildError(f"llama_cpp: the GGUF does not hold the planned tensor types: {wrong}")
    return f"{note}; {caveat}" if caveat else note


def _precision_plan(model: Any, step: LlamaCppStep, f32: Path, imatrix: Any, context: Any) -> Any:
    """Which layers stay Q8_0 around `step.type`: what each layer at Q8_0 saves, and then each plan, quantized and
    measured in llama.cpp on the calibration split (never the evaluation's). The diagonal-Fisher prediction the ONNX
    search ranks by does not carry over: with an importance matrix llama.cpp's 4-bit rounding error is not the
    simulated grid's, and measured per layer it ranked the wrong matrices on SmolLM2."""
    from tasks.engines.llama_cpp import runtime as llama_cpp
    from tasks.techniques.mixed_precision_search import Goal, Grid, search

    settings = step.mixed_precision
    windows = context.sequences(context.tokenizer, settings.window_tokens, limit=settings.windows)
    threads = len(os.sched_getaffinity(0))
    trial = f32.with_name("plan.gguf")

    def measure(plan: dict[str, int] | None, quick: bool = False) -> float:
        sample = windows[: max(1, len(windows) // 4)] if quick else windows  # quick: a layer's sensitivity
        if plan is None:
            return llama_cpp.gguf_loss(f32, sample, threads)
        # the kept tensors at 8 bits; the rest as llama.cpp stores `step.type` (its own per-tensor choices included)
        types = {name: gguf.PLAN_TYPES[bits] for name, bits in plan.items() if bits == 8}
        gguf.quantize_gguf(f32, trial, step.type, imatrix, threads, tensor_types=types)
        try:
            return llama_cpp.gguf_loss(trial, sample, threads)
        finally:
            trial.unlink()

    twin = _torch_twin(model, step, context) if settings.sensitivity == "simulated" else None
    with step_arguments("llama_cpp"):
        plan = search(
            model,
            windows,
            Goal(settings.target_ppl_increase, settings.size_budget),
            Grid(gguf.BLOCK, True, scale_bytes=gguf.SCALE_BYTES, int4_weights=twin),
            context.report,
            matrices=gguf.gguf_matrices(model),
            measure=measure,
            group=gguf.layer_of,
            groups_in_torch=twin is not None,
        )
    if twin is not None:
        plan.sensitivity = "simulated per layer (torch twin), plans measured in llama.cpp"
    plan.kept_as = gguf.PLAN_TYPES[8]
    return plan


def _torch_twin(model: Any, step: LlamaCppStep, context: Any) -> dict[str, Any]:
    """Every decoder matrix on llama.cpp's Q4_0-with-importance-matrix grid, simulated in torch: symmetric blocks of
    32, each block's scale chosen by llama.cpp's own search (make_qx_quants) weighted by the mean squared input on
    the calibration windows the importance matrix reads. Rounded with the ONNX export's matrices and windows, so
    the statistics cache gives both the same result once."""
    from tasks.techniques.gptq_rounding import round_matrices
    from tasks.techniques.mixed_precision import export_matrices

    windows = context.sequences(context.tokenizer, WINDOW_TOKENS, limit=step.imatrix_windows)
    modules = dict(model.named_modules())
    with step_arguments("llama_cpp"):
        chosen = {name: modules[name] for m in export_matrices(model) for name in m.modules}
    rounded = round_matrices(model, chosen, windows, gguf.BLOCK, "rtn", "weighted", context.report)
    return {name: weights.dequantized() for name, weights in rounded.items()}


def _shipped(dest: Path, context: Any) -> tuple[str, int]:
    """The source's own GGUF copied into `dest`: (note, parameter count read from the file)."""
    import shutil

    from gguf import GGUFReader

    from tasks.engines.llama_cpp import runtime as llama_cpp

    with step_arguments("llama_cpp"):
        shipped = gguf.shipped_gguf(context.source)
    shutil.copyfile(shipped, dest / llama_cpp.MODEL_FILE)
    parameters = sum(int(tensor.n_elements) for tensor in GGUFReader(str(shipped)).tensors)
    return (
        f"llama.cpp, the source's own GGUF as shipped ({shipped.name}): the peer row, never selected",
        parameters,
    )

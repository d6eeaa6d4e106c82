"""optimize: apply a variant's recipe (ordered steps + runtime dtype) to the base model and save the artifact."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import LlamaCppStep, OnnxGenAIStep, Step, VariantConfig
from tasks.engines import llama_cpp, onnx_genai, pytorch
from tasks.engines.llama_cpp import GGUF
from tasks.engines.manifest import MANIFEST_FILE, VariantManifest, integrity_problem, read_manifest
from tasks.engines.onnx_genai import ONNX_GENAI
from tasks.engines.torch_weights import HF_SAFETENSORS
from tasks.errors import ConfigError, ModelSourceError
from tasks.failpoints import failpoint
from tasks.inputs.load import PreparedBase, save_tokenizer
from tasks.storage import code_sha256, combined_sha256, file_hashes, folder_size, staged_folder
from tasks.techniques.onnx_export import build_onnx_genai, weight_bits


@dataclass
class BuildContext:
    """What steps may need besides the model: calibration text, a checkpoint folder, progress, a training log."""

    calibration_texts: list[str]
    checkpoints: Path
    progress: Callable[[str, int, int], None] | None = None
    tokenizer: Any = None  # the base model's, set when the recipe starts
    history: dict[str, list[float]] = field(default_factory=dict)  # per-step training losses, for MLflow
    mixed_precision: dict[str, Any] = field(default_factory=dict)  # the int4/int8 plan of a mixed export
    source: str = ""  # the model source (params.yaml model.source): where a shipped GGUF comes from

    def sequences(self, tokenizer: Any, length: int, limit: int | None = None) -> list[list[int]]:
        """The calibration split as token sequences of `length` (the tail shorter than 8 tokens dropped)."""
        if not self.calibration_texts:
            raise ModelSourceError("this step needs the calibration split, which is empty")
        ids = tokenizer("\n\n".join(self.calibration_texts), add_special_tokens=False)["input_ids"]
        chunks = [ids[i : i + length] for i in range(0, len(ids), length) if len(ids[i : i + length]) >= 8]
        return chunks[:limit]

    def report(self, label: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(label, done, total)


class StepArgumentError(ValueError):
    """A step's settings do not fit this model (e.g. more head groups removed than it has)."""


@contextlib.contextmanager
def _step_arguments(kind: str) -> Iterator[None]:
    """The step modules raise ValueError naming the argument; that is the user's setting, not a bug."""
    try:
        yield
    except ValueError as exc:
        raise StepArgumentError(f"{kind}.{exc}") from exc


def _quantize_step(model: Any, step: Step, context: BuildContext) -> tuple[Any, str, str]:
    from tasks.techniques.quantize import NOTES, quantize_model

    calibration = (
        context.sequences(context.tokenizer, 256, limit=16) if step.quantize.method == "quanto_w8a8" else []
    )
    with _step_arguments("quantize"):
        model, weights_format = quantize_model(model, step.quantize, calibration)
    return model, weights_format, NOTES[step.quantize.method]


def _prune_step(model: Any, step: Step, context: BuildContext) -> tuple[Any, str, str]:
    from tasks.techniques import prune

    cfg, tokenizer = step.prune, context.tokenizer
    with _step_arguments("prune"):
        if cfg.method == "unstructured":
            report = prune.prune_unstructured(model, cfg.sparsity, cfg.scope)
        else:
            activation = cfg.importance == "activation"
            calibration = context.sequences(tokenizer, 256, limit=16) if activation else None
            report = prune.prune_structured(
                model, cfg.mlp_fraction, cfg.head_groups, cfg.importance, calibration
            )
    note = f"{report.method}: {report.parameters_before:,} → {report.parameters_after:,} parameters, "
    note += f"{report.sparsity:.1%} zeros in decoder matrices. {report.note}"
    if cfg.heal_steps:
        steps, batches = cfg.heal_steps, context.sequences(tokenizer, 256)
        losses = prune.heal(model, batches, steps, cfg.heal_lr, lambda i, _: context.report("heal", i, steps))
        context.history["heal_loss"] = losses
        note += f" Healed {steps} steps: loss {losses[0]:.3f} → {losses[-1]:.3f}."
    return model, HF_SAFETENSORS, note


def _distill_step(model: Any, step: Step, context: BuildContext) -> tuple[Any, str, str]:
    from tasks.techniques.distill import DistillSettings, build_student, distill

    cfg = step.distill
    with _step_arguments("distill"):
        student = build_student(model, *cfg.student_depth())
    settings = DistillSettings(**cfg.model_dump(exclude={"keep_every", "layers", "sequence_tokens"}))
    result = distill(
        model,
        student,
        context.sequences(context.tokenizer, cfg.sequence_tokens),
        settings,
        context.checkpoints,
        lambda i, _: context.report("distill", i, cfg.steps),
    )
    for key in ("loss", "kl", "ce"):
        context.history[f"distill_{key}"] = [entry[key] for entry in result.history]
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    note = (
        f"distilled into {student.config.num_hidden_layers} of {model.config.num_hidden_layers} layers: "
        f"{result.step} steps (stopped by {result.stopped_by}), loss {first:.3f} → {last:.3f}"
    )
    return student, HF_SAFETENSORS, note


STEP_APPLIERS: dict[str, Callable[[Any, Step, BuildContext], tuple[Any, str, str]]] = {
    "prune": _prune_step,
    "distill": _distill_step,
    "quantize": _quantize_step,
}


EXPORT_STEPS = ("onnx_genai", "llama_cpp")  # steps that hand the model to another engine (always last)

# What writes a variant's bytes: the build steps and the weights formats they save.
BUILDER_MODULES = ("tasks.techniques", "tasks.engines.torch_weights", "tasks.engines.manifest")


def variant_build_key(variant: VariantConfig, base_hash: str, data_hash: str) -> str:
    """Content address of a variant: same base, data, recipe, builder code and libraries → same artifact."""
    builder = code_sha256(BUILDER_MODULES)
    versions = ",".join(f"{k}={v}" for k, v in sorted(_library_versions().items()))
    settings = json.dumps(
        variant.model_dump(mode="json"), sort_keys=True
    )  # defaults resolved: a changed default rebuilds
    key = f"{base_hash}\0{data_hash}\0{variant.recipe_hash()}\0{settings}\0{builder}\0{versions}"
    return hashlib.sha256(key.encode()).hexdigest()


def build_variant(
    name: str,
    variant: VariantConfig,
    base: PreparedBase,
    data_hash: str,
    out_dir: Path,
    calibration: list[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> VariantManifest:
    """Build the variant into `out_dir`, or return the existing manifest when an intact artifact has the same key.

    `calibration` is the calibration split's text (pruning importance, healing, distillation); long training
    steps checkpoint beside `out_dir` and resume there after an interruption.
    """
    build_key = variant_build_key(variant, base.content_hash, data_hash)
    existing = _reusable_manifest(out_dir, build_key)
    if existing is not None:
        return existing
    checkpoints = out_dir.with_name(out_dir.name + ".checkpoint") / build_key[:16]
    context = BuildContext(list(calibration or []), checkpoints, progress, source=base.source)
    with staged_folder(out_dir) as staging:  # nothing half-built stays behind (checkpoints do)
        try:
            weights_format, engine, parameters, notes = _apply_recipe(variant, base.path, staging, context)
        except StepArgumentError as exc:
            raise ConfigError(f"params.yaml: variants.{name}.steps: {exc}") from exc
        failpoint("optimize")  # tests: SIGKILL with the variant half written
        files = file_hashes(staging)
        manifest = VariantManifest(
            name=name,
            recipe=variant.recipe(),
            recipe_hash=variant.recipe_hash(),
            build_key=build_key,
            base_hash=base.content_hash,
            data_hash=data_hash,
            weights_format=weights_format,
            dtype=variant.runtime.dtype,
            engine=engine,
            parameters=parameters,
            size_bytes=folder_size(staging),
            content_hash=combined_sha256(files),
            notes=notes,
            versions=_library_versions(),
            training=context.history,
            mixed_precision=context.mixed_precision,
            files=files,
        )
        manifest.write(staging)
    shutil.rmtree(checkpoints.parent, ignore_errors=True)
    return manifest


def _reusable_manifest(out_dir: Path, build_key: str) -> VariantManifest | None:
    """The manifest of an intact artifact built with `build_key` in `out_dir`, else None (build it again; a
    damaged artifact is named in the log)."""
    if not (out_dir / MANIFEST_FILE).is_file():
        return None
    try:
        manifest = read_manifest(out_dir)
    except ModelSourceError:
        return None
    if manifest.build_key != build_key:
        return None
    problem = integrity_problem(out_dir, manifest)
    if problem:
        logging.getLogger(__name__).warning(f"{out_dir}: {problem}; building it again")
        return None
    return manifest


def _apply_recipe(
    variant: VariantConfig, base_path: Path, dest: Path, context: BuildContext
) -> tuple[str, str, int, list[str]]:
    """Run the steps; returns (weights format, engine, parameter count after the steps, notes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    context.tokenizer = AutoTokenizer.from_pretrained(base_path)
    if variant.peer:  # the source's own GGUF copied as is: no float model to load
        note, parameters = _shipped_gguf(dest, context)
        return GGUF, llama_cpp.ENGINE, parameters, [note]
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=False)
    weights_format, notes = HF_SAFETENSORS, []
    torch_steps = [step for step in variant.steps if step.kind not in EXPORT_STEPS]
    parameters = sum(p.numel() for p in model.parameters())
    for step in torch_steps:
        model, weights_format, note = STEP_APPLIERS[step.kind](model, step, context)
        if step.kind != "quantize":  # quantized modules hide their weights from .parameters()
            parameters = sum(p.numel() for p in model.parameters())
        notes.append(note)
    gguf_step = next((step.llama_cpp for step in variant.steps if step.llama_cpp is not None), None)
    if gguf_step is not None:
        notes.append(_gguf_export(model, gguf_step, base_path, dest, context, changed=bool(torch_steps)))
        save_tokenizer(context.tokenizer, dest)
        return GGUF, llama_cpp.ENGINE, parameters, notes
    export = next((step.onnx_genai for step in variant.steps if step.onnx_genai is not None), None)
    if export is not None:
        plan = _mixed_precision_plan(model, export, context) if export.mixed_precision else None
        if export.rounding == "gptq":
            notes.append(_gptq_rounding(model, export, plan, context))
        with tempfile.TemporaryDirectory(prefix="llmopt-export-") as scratch:
            changed = torch_steps or export.rounding != "rtn"
            source = base_path if not changed else _save_float_model(model, context.tokenizer, Path(scratch))
            options = plan.builder_options() if plan else None
            build_onnx_genai(source, dest, export, Path(scratch) / "builder-cache", options)
        save_tokenizer(context.tokenizer, dest)  # over the builder's copy
        note = f"ONNX Runtime GenAI {export.precision}, block {export.block_size}, accuracy level {export.accuracy_level}"
        if plan:
            _check_plan_applied(plan, dest)
            context.mixed_precision = plan.to_dict()
            note += f"; {plan.note()}"
        return ONNX_GENAI, onnx_genai.ENGINE, parameters, [*notes, note]
    save_tokenizer(context.tokenizer, dest)
    if weights_format != HF_SAFETENSORS:
        from tasks.techniques.quantize import save_quantized

        save_quantized(model, weights_format, dest)
    else:
        model.to(getattr(torch, variant.runtime.dtype)).save_pretrained(dest)
    return weights_format, pytorch.ENGINE, parameters, notes


def _gguf_export(
    model: Any, step: LlamaCppStep, base_path: Path, dest: Path, context: BuildContext, changed: bool
) -> str:
    """The model as a llama.cpp GGUF of `step.type` in `dest`."""
    from tasks.techniques import gguf

    with tempfile.TemporaryDirectory(prefix="llmopt-gguf-") as scratch:
        source = _save_float_model(model, context.tokenizer, Path(scratch)) if changed else base_path
        f32 = Path(scratch) / "model-f32.gguf"
        caveat = gguf.convert_to_gguf(source, f32)
        imatrix, note = None, f"llama.cpp {step.type}"
        if step.imatrix:
            windows = context.sequences(
                context.tokenizer, gguf.IMATRIX_WINDOW_TOKENS, limit=step.imatrix_windows
            )
            imatrix = gguf.importance_matrix(model, windows, context.report)
            note += f", importance matrix of {len(imatrix)} tensors from {sum(map(len, windows)):,} calibration tokens"
        types = None
        if step.mixed_precision:
            plan = _gguf_precision_plan(model, step, f32, imatrix, context)
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
                raise ModelSourceError(f"llama_cpp: the GGUF does not hold the planned tensor types: {wrong}")
    return f"{note}; {caveat}" if caveat else note


def _gguf_precision_plan(
    model: Any, step: LlamaCppStep, f32: Path, imatrix: Any, context: BuildContext
) -> Any:
    """Which layers stay Q8_0 around `step.type`: what each layer at Q8_0 saves, and then each plan, quantized and
    measured in llama.cpp on the calibration split (never the evaluation's). The diagonal-Fisher prediction the ONNX
    search ranks by does not carry over: with an importance matrix llama.cpp's 4-bit rounding error is not the
    simulated grid's, and measured per layer it ranked the wrong matrices on SmolLM2."""
    import os

    from tasks.techniques import gguf
    from tasks.techniques.mixed_precision import search

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

    with _step_arguments("llama_cpp"):
        plan = search(
            model,
            windows,
            settings.target_ppl_increase,
            settings.size_budget,
            gguf.BLOCK,
            True,
            context.report,
            matrices=gguf.gguf_matrices(model),
            measure=measure,
            scale_bytes=gguf.SCALE_BYTES,
            group=gguf.layer_of,
        )
    plan.kept_as = gguf.PLAN_TYPES[8]
    return plan


def _shipped_gguf(dest: Path, context: BuildContext) -> tuple[str, int]:
    """The source's own GGUF copied into `dest`: (note, parameter count read from the file)."""
    from gguf import GGUFReader

    from tasks.techniques import gguf

    with _step_arguments("llama_cpp"):
        shipped = gguf.shipped_gguf(context.source)
    shutil.copyfile(shipped, dest / llama_cpp.MODEL_FILE)
    save_tokenizer(context.tokenizer, dest)
    parameters = sum(int(tensor.n_elements) for tensor in GGUFReader(str(shipped)).tensors)
    return (
        f"llama.cpp, the source's own GGUF as shipped ({shipped.name}): the peer row, never selected",
        parameters,
    )


def _mixed_precision_plan(model: Any, export: OnnxGenAIStep, context: BuildContext) -> Any:
    """Which matrices the int4 export keeps at int8, searched on the calibration split (never the evaluation's)."""
    from tasks.techniques.mixed_precision import search

    settings = export.mixed_precision
    windows = context.sequences(context.tokenizer, settings.window_tokens, limit=settings.windows)
    with _step_arguments("onnx_genai"):
        return search(
            model,
            windows,
            settings.target_ppl_increase,
            settings.size_budget,
            export.block_size,
            export.symmetric,
            context.report,
        )


def _gptq_rounding(model: Any, export: OnnxGenAIStep, plan: Any, context: BuildContext) -> str:
    """GPTQ-round (in place, onto the export's int4 grid) every matrix the export stores at int4."""
    from tasks.techniques.gptq import GPTQ_WINDOW_TOKENS, GPTQ_WINDOWS, apply_gptq
    from tasks.techniques.mixed_precision import export_matrices

    windows = context.sequences(context.tokenizer, GPTQ_WINDOW_TOKENS, limit=GPTQ_WINDOWS)
    with _step_arguments("onnx_genai"):
        matrices = export_matrices(model)
    keep = set(plan.int8_nodes) if plan else set()
    rounded = apply_gptq(model, matrices, windows, export.block_size, keep, context.report)
    tokens = sum(len(ids) for ids in windows)
    return f"GPTQ rounding of {rounded} of {len(matrices)} matrices on {tokens:,} calibration tokens"


def _check_plan_applied(plan: Any, dest: Path) -> None:
    """The exported graph has int8 exactly where the plan put it (a builder that ignored an override is named)."""
    exported = weight_bits(dest)
    wanted = {choice.node: choice.bits for choice in plan.matrices}
    differing = [node for node, bits in wanted.items() if exported.get(node) != bits]
    embedding = "/model/embed_tokens/GatherBlockQuantized"
    if plan.tied_embeddings and wanted.get("/lm_head/MatMul") == 4 and embedding not in exported:
        differing = [embedding]
        wanted[embedding] = 4
    if differing:
        raise ModelSourceError(
            f"onnx_genai: the model builder did not apply the mixed-precision plan to {differing[0]} "
            f"(wanted {wanted[differing[0]]} bits, the graph has {exported.get(differing[0])})"
        )


def _save_float_model(model: Any, tokenizer: Any, folder: Path) -> Path:
    """The changed float model as an HF folder (the ONNX builder reads the tokenizer from it too)."""
    model.save_pretrained(folder / "model")
    save_tokenizer(tokenizer, folder / "model")
    return folder / "model"


def _library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for package in (
        "torch",
        "transformers",
        "onnxruntime-genai",
        "torchao",
        "optimum-quanto",
        "bitsandbytes",
        "llama-cpp-python",
    ):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions

"""build: the recipe runner. Applies a variant's steps, each through its registered technique
(tasks/techniques/registry.py), to the base model, and saves the artifact with its manifest."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.engines.manifest import MANIFEST_FILE, VariantManifest, integrity_problem, read_manifest
from tasks.engines.pytorch import runtime as pytorch
from tasks.engines.registry import SERVING_ONLY, engine_libraries
from tasks.engines.speculative import DRAFT_FOLDER
from tasks.errors import ArtifactError, BuildError, ConfigError
from tasks.failpoints import failpoint
from tasks.inputs.load import PreparedBase, save_tokenizer
from tasks.local_files import code_sha256, combined_sha256, file_hashes, folder_size, staged_folder
from tasks.params import VariantConfig
from tasks.techniques.calibration import calibration_device, statistics_cache
from tasks.techniques.quantize.methods import METHODS
from tasks.techniques.registry import ExportJob, StepArgumentError
from tasks.weights.catalog import weights_format as stored_format
from tasks.weights.safetensors import HF_SAFETENSORS


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
            raise BuildError("this step needs the calibration split, which is empty")
        ids = tokenizer("\n\n".join(self.calibration_texts), add_special_tokens=False)["input_ids"]
        chunks = [ids[i : i + length] for i in range(0, len(ids), length) if len(ids[i : i + length]) >= 8]
        return chunks[:limit]

    def report(self, label: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(label, done, total)


# What writes a variant's bytes: the build steps and the weights formats they save.
BUILDER_MODULES = (
    "tasks.techniques",
    "tasks.weights",
    "tasks.engines.onnx",  # the exports write the engines' bytes (and the runtimes beside them measure plans)
    "tasks.engines.llama_cpp",
    "tasks.engines.manifest",
)


def variant_build_key(
    variant: VariantConfig, base_hash: str, data_hash: str, draft: VariantConfig | None = None
) -> str:
    """Content address of a variant: same base, data, recipe, builder code and libraries → same artifact (and,
    for a speculative variant with a draft, the draft's own address)."""
    builder = code_sha256(BUILDER_MODULES, skip=SERVING_ONLY)
    versions = ",".join(f"{k}={v}" for k, v in sorted(_library_versions().items()))
    resolved = {**variant.model_dump(mode="json"), "runtime": variant.runtime.identity()}
    settings = json.dumps(resolved, sort_keys=True)  # defaults resolved: a changed default rebuilds
    key = f"{base_hash}\0{data_hash}\0{variant.recipe_hash()}\0{settings}\0{builder}\0{versions}"
    if draft is not None:
        key += "\0" + variant_build_key(draft, base_hash, data_hash)
    return hashlib.sha256(key.encode()).hexdigest()


def plain_twin(variant: VariantConfig) -> VariantConfig | None:
    """The same recipe without speculative decoding (its bytes are the speculative variant's), or None when the
    variant does not speculate."""
    if variant.runtime.speculative is None:
        return None
    runtime = variant.runtime.model_dump(exclude_unset=True, exclude={"speculative"})
    return VariantConfig.model_validate({**variant.recipe(), "runtime": runtime})


def build_order(variants: dict[str, VariantConfig], names: list[str]) -> list[tuple[str, list[str]]]:
    """`names` in the order to build them, each with the variants whose build it waits for: a speculative variant
    after the ones whose bytes it links (its plain twin, whose bytes it shares, and its draft); the others in the
    order given, waiting for none."""
    order = sorted(names, key=lambda name: variants[name].runtime.speculative is not None)
    plan: list[tuple[str, list[str]]] = []
    for name in order:
        variant, twin = variants[name], plain_twin(variants[name])
        draft = variant.runtime.speculative.draft if variant.runtime.speculative else None
        earlier = [other for other, _ in plan]
        plan.append((name, [o for o in earlier if o == draft or (twin is not None and variants[o] == twin)]))
    return plan


def build_variant(
    name: str,
    variant: VariantConfig,
    base: PreparedBase,
    data_hash: str,
    out_dir: Path,
    calibration: list[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    statistics: Path | None = None,
    draft: tuple[str, VariantConfig] | None = None,
    siblings: Path | None = None,
    device: str = "cpu",
) -> VariantManifest:
    """Build the variant into `out_dir`, or return the existing manifest when an intact artifact has the same key.

    `calibration` is the calibration split's text (pruning importance, healing, distillation); long training
    steps checkpoint beside `out_dir` and resume there after an interruption. `statistics`: the folder of
    content-addressed calibration captures shared by every variant and run (tasks/techniques/calibration.py).
    `draft`: the (name, recipe) of the variant a `speculative: {method: draft}` variant proposes with, built into
    its `draft/` folder. `siblings` (default: `out_dir`'s folder): where other variants' folders lie; bytes one
    of them already holds under the same key are linked, not built again (a speculative variant's weights are its
    plain twin's, a draft's are its own variant's). `device`: the target's, where calibration runs when torch sees
    it (tasks/techniques/calibration.py `calibration_device`; the bytes are the same method's either way, so not
    part of the key).
    """
    siblings = siblings or out_dir.parent
    speculative = variant.runtime.speculative
    if (
        speculative is not None
        and speculative.method == "draft"
        and (draft is None or draft[0] != speculative.draft)
    ):
        raise ConfigError(
            f"params.yaml: variants.{name}: its draft {speculative.draft!r} must be built with it (pass its recipe)"
        )
    build_key = variant_build_key(variant, base.content_hash, data_hash, draft[1] if draft else None)
    existing = _reusable_manifest(out_dir, build_key)
    if existing is not None:
        return existing
    checkpoints = out_dir.with_name(out_dir.name + ".checkpoint") / build_key[:16]
    context = BuildContext(list(calibration or []), checkpoints, progress, source=base.source)
    twin = plain_twin(variant)
    # nothing half-built stays behind
    with staged_folder(out_dir) as staging, statistics_cache(statistics), calibration_device(device):
        built = _linked_from_sibling(
            siblings,
            build_key if twin is None else variant_build_key(twin, base.content_hash, data_hash),
            staging,
        )
        if built is not None:
            weights_format, engine, parameters = built.weights_format, built.engine, built.parameters
            notes = list(built.notes)
            context.history, context.mixed_precision = dict(built.training), dict(built.mixed_precision)
        else:
            try:
                weights_format, engine, parameters, notes = _apply_recipe(
                    variant, base.path, staging, context
                )
            except StepArgumentError as exc:
                raise ConfigError(f"params.yaml: variants.{name}.steps: {exc}") from exc
        if draft is not None:
            build_variant(
                draft[0],
                draft[1],
                base,
                data_hash,
                staging / DRAFT_FOLDER,
                calibration,
                progress,
                statistics,
                siblings=siblings,
                device=device,
            )
        if variant.runtime.speculative is not None:
            notes.append(_speculation_note(variant))
        failpoint("build")  # tests: SIGKILL with the variant half written
        files = file_hashes(staging)
        manifest = VariantManifest(
            name=name,
            recipe=variant.recipe(),
            recipe_hash=variant.recipe_hash(),
            build_key=build_key,
            base_hash=base.content_hash,
            data_hash=data_hash,
            weights_format=weights_format,
            # a format that fixes its dtype (torchao's on-load methods compute in bfloat16) over runtime.dtype
            dtype=_stored_dtype(weights_format, engine, staging) or variant.runtime.dtype,
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


def _speculation_note(variant: VariantConfig) -> str:
    settings = variant.runtime.speculative
    how = (
        f"draft variant {settings.draft}"
        if settings.method == "draft"
        else f"n-gram lookup (≤ {settings.ngram_size})"
    )
    return f"speculative decoding at batch 1: {how} proposes up to {settings.tokens} tokens per check"


def _linked_from_sibling(siblings: Path, build_key: str, dest: Path) -> VariantManifest | None:
    """When an intact variant folder in `siblings` was built under `build_key`, its files linked (or copied)
    into `dest`, its manifest returned; else None."""
    if not siblings.is_dir():
        return None
    for folder in sorted(siblings.iterdir()):
        finished = (
            folder.is_dir() and folder != dest and not folder.name.endswith((".partial", ".checkpoint"))
        )
        manifest = _reusable_manifest(folder, build_key) if finished else None
        if manifest is None:
            continue
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            relative = path.relative_to(folder)
            if relative.as_posix() == MANIFEST_FILE:
                continue
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)  # the same bytes; a later rebuild of the sibling replaces its own files
            except OSError:
                shutil.copy2(path, target)
        return manifest
    return None


def _reusable_manifest(out_dir: Path, build_key: str) -> VariantManifest | None:
    """The manifest of an intact artifact built with `build_key` in `out_dir`, else None (build it again; a
    damaged artifact is named in the log)."""
    if not (out_dir / MANIFEST_FILE).is_file():
        return None
    try:
        manifest = read_manifest(out_dir)
    except ArtifactError:
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
    """Run the steps (each through its registered technique); returns (weights format, engine, parameter count
    after the steps, notes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    context.tokenizer = AutoTokenizer.from_pretrained(base_path)
    torch_steps = [step for step in variant.steps if step.technique.role != "export"]
    export = next((step for step in variant.steps if step.technique.role == "export"), None)
    model, parameters, weights_format, notes, record = None, 0, HF_SAFETENSORS, [], None
    if export is None or export.technique.needs_model(export.settings):
        model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=False)
        parameters = sum(p.numel() for p in model.parameters())
    for step in torch_steps:
        applied = step.technique.apply(model, step.settings, context)
        model, weights_format, record = applied.model, applied.weights_format, applied.record
        if step.technique.role != "quantize":  # quantized modules hide their weights from .parameters()
            parameters = sum(p.numel() for p in model.parameters())
        notes.append(applied.note)
    if export is not None:
        job = ExportJob(base_path, dest, context, changed=bool(torch_steps))
        exported = export.technique.export(model, export.settings, job)
        save_tokenizer(context.tokenizer, dest)  # over an exporter's copy
        parameters = exported.parameters if exported.parameters is not None else parameters
        return exported.weights_format, exported.engine, parameters, [*notes, *exported.notes]
    save_tokenizer(context.tokenizer, dest)
    stored_format(weights_format, dest).save(model, dest, variant.runtime.dtype, record)
    return weights_format, pytorch.ENGINE, parameters, notes


def _stored_dtype(weights_format: str, engine: str, folder: Path) -> str | None:
    """The dtype a torch weights format fixes whatever runtime.dtype says (None: the runtime's)."""
    return stored_format(weights_format, folder).dtype if engine == pytorch.ENGINE else None


def _library_versions() -> dict[str, str]:
    """Versions of what builds and runs variants: every registered engine's libraries and every quantize method's
    packages (a package that is not installed is left out)."""
    from importlib import metadata

    versions = {}
    for package in sorted(
        {*engine_libraries(), *(p for method in METHODS.values() for p in method.packages)}
    ):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions

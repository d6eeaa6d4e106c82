"""onnx_genai step: export a float HF folder to ONNX Runtime GenAI with its model builder (int4/int8/fp32), after
an optional mixed-precision search (tasks/techniques/mixed_precision.py) and GPTQ rounding (tasks/techniques/gptq_rounding.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, model_validator

from tasks.errors import BuildError
from tasks.failpoints import failpoint
from tasks.schema import Strict
from tasks.techniques.calibration import WINDOW_TOKENS
from tasks.techniques.mixed_precision import MixedPrecision
from tasks.techniques.registry import (
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

PRECISION_BITS = {"fp32": 32, "int8": 8, "int4": 4}


class OnnxGenAIStep(Strict):
    """Export to ONNX Runtime GenAI with its model builder; int4/int8 are weight-only (MatMulNBits) block-wise."""

    RECORDED_DEFAULTS = frozenset({"precision", "block_size", "symmetric", "accuracy_level"})
    precision: Literal["int4", "int8", "fp32"] = "int4"
    block_size: Literal[16, 32, 64, 128, 256] = 32
    symmetric: bool = True
    # 4 = int8 activations inside the int4/int8 MatMuls (VNNI kernels on AVX-512 CPUs); 0 = builder default.
    accuracy_level: Literal[0, 1, 2, 3, 4] = 4
    mixed_precision: MixedPrecision | None = None  # int4 only: keep the most sensitive matrices at int8
    # int4 only: how weights are rounded. rtn: the builder's round-to-nearest; gptq: GPTQ on the calibration split
    # onto the same grid (symmetric only), which the builder then stores as is (tasks/techniques/gptq_rounding.py)
    rounding: Literal["rtn", "gptq"] = "rtn"
    # rounding gptq: calibration windows (of 256 tokens) the Hessians are collected on
    gptq_windows: Annotated[int, Field(ge=1, le=4096)] = 32

    @model_validator(mode="after")
    def _int4_options(self) -> OnnxGenAIStep:
        for name in ("mixed_precision", "rounding"):
            if name in self.model_fields_set and self.precision != "int4":
                raise ValueError(f"{name} applies to precision int4, not {self.precision}")
        if "gptq_windows" in self.model_fields_set and self.rounding != "gptq":
            raise ValueError("gptq_windows applies only with rounding: gptq")
        if self.rounding == "gptq" and not self.symmetric:
            raise ValueError("rounding: gptq rounds onto the symmetric grid; leave symmetric at true")
        return self


@register
class OnnxGenAI(Technique):
    name = "onnx_genai"
    settings = OnnxGenAIStep
    role = "export"
    engine_label = "ONNX Runtime GenAI"

    def export(self, model: Any, settings: OnnxGenAIStep, job: ExportJob) -> Exported:
        from tasks.engines import onnx_genai
        from tasks.engines.onnx_genai import ONNX_GENAI

        export, context, notes = settings, job.context, []
        plan = _mixed_precision_plan(model, export, context) if export.mixed_precision else None
        if export.rounding == "gptq":
            notes.append(_gptq_rounding(model, export, plan, context))
        with tempfile.TemporaryDirectory(prefix="llmopt-export-") as scratch:
            changed = job.changed or export.rounding != "rtn"
            source = (
                job.base_path if not changed else save_float_model(model, context.tokenizer, Path(scratch))
            )
            options = plan.builder_options() if plan else None
            build_onnx_genai(source, job.dest, export, Path(scratch) / "builder-cache", options)
        note = f"ONNX Runtime GenAI {export.precision}, block {export.block_size}, accuracy level {export.accuracy_level}"
        if plan:
            _check_plan_applied(plan, job.dest)
            context.mixed_precision = plan.to_dict()
            note += f"; {plan.note()}"
        return Exported(ONNX_GENAI, onnx_genai.ENGINE, [*notes, note])

    def problems(self, where: str, settings: OnnxGenAIStep, config: Any, cuda_available: bool) -> list[str]:
        if config.target.is_cuda:
            return [
                f"{where}: the export targets ONNX Runtime's CPU provider (onnxruntime-genai-cuda is not installed); "
                f"on {config.target.device} use torch variants (runtime.dtype bfloat16 or float16)"
            ]
        return []

    def weight_bits(self, settings: OnnxGenAIStep, manifest: VariantManifest) -> int | None:
        return PRECISION_BITS[settings.precision]

    def rows(self) -> list[Row]:
        mixed = tuple(f"mixed_precision.{name}" for name in MixedPrecision.model_fields)
        return [
            Row(
                "`onnx_genai: {precision: int4 \\| int8 \\| fp32}`",
                ("precision", "block_size", "symmetric", "accuracy_level"),
                "export with ONNX Runtime GenAI's model builder (offline, from the local or pruned/distilled "
                "folder); int4/int8 weight-only block-wise (MatMulNBits); `accuracy_level: 4` = int8 activations "
                "inside (VNNI)",
            ),
            Row(
                "`onnx_genai: {precision: int4, rounding: gptq}`",
                ("rounding", "gptq_windows"),
                "GPTQ on CPU: `gptq_windows` calibration windows of 256 tokens give each matrix's input Hessian (every token "
                "scaled to unit length, so the attention-sink positions, whose activations are hundreds of times "
                "the others', do not dominate it); each block of 32 inputs keeps onnxruntime's own symmetric scale "
                "and its largest element level −8, so the rounded float weights are a fixed point of the builder's "
                "round-to-nearest and the export stores GPTQ's integers (tested). The tied lm_head is rounded too "
                "(its table is the int4 embedding's). Symmetric int4 only",
            ),
            Row(
                "`onnx_genai: {precision: int4, mixed_precision: {…}}`",
                mixed,
                "accuracy-aware mixed precision: every matrix the export quantizes (a layer's fused q/k/v, o, "
                "gate, up, down, the lm_head) gets its loss cost at int4 and int8 from the empirical Fisher "
                "diagonal × the squared rounding error of onnxruntime's own grid (tested equal), scaled to the "
                "measured all-int4 loss; matrices are kept at int8 by loss saved per byte until the calibration "
                "perplexity increase fits the target or the bytes (share of an all-int8 export) are spent, each "
                "plan measured again. Calibration split only; the plan (per-matrix bits, predicted and measured "
                "increases) is in the manifest and the MLflow run, and the exported graph is checked to carry it",
            ),
        ]


def _mixed_precision_plan(model: Any, export: OnnxGenAIStep, context: Any) -> Any:
    """Which matrices the int4 export keeps at int8, searched on the calibration split (never the evaluation's)."""
    from tasks.techniques.mixed_precision import search

    settings = export.mixed_precision
    windows = context.sequences(context.tokenizer, settings.window_tokens, limit=settings.windows)
    with step_arguments("onnx_genai"):
        return search(
            model,
            windows,
            settings.target_ppl_increase,
            settings.size_budget,
            export.block_size,
            export.symmetric,
            context.report,
        )


def _gptq_rounding(model: Any, export: OnnxGenAIStep, plan: Any, context: Any) -> str:
    """GPTQ-round (in place, onto the export's int4 grid) every matrix the export stores at int4."""
    from tasks.techniques.gptq_rounding import apply_gptq
    from tasks.techniques.mixed_precision import export_matrices

    windows = context.sequences(context.tokenizer, WINDOW_TOKENS, limit=export.gptq_windows)
    with step_arguments("onnx_genai"):
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
        raise BuildError(
            f"onnx_genai: the model builder did not apply the mixed-precision plan to {differing[0]} "
            f"(wanted {wanted[differing[0]]} bits, the graph has {exported.get(differing[0])})"
        )


def build_onnx_genai(
    source: Path, dest: Path, step: OnnxGenAIStep, cache: Path, target_options: dict | None = None
) -> None:
    """Run ONNX Runtime GenAI's model builder offline on an HF folder; its log is shown only if it fails.
    `target_options`: the builder's structured options (e.g. per-node weight types of a mixed-precision plan)."""
    options = [f"block_size={step.block_size}", f"is_symmetric={str(step.symmetric).lower()}"]
    if step.accuracy_level:
        options.append(f"accuracy_level={step.accuracy_level}")
    if not step.symmetric:
        # builder 0.18 emits an invalid graph for an asymmetric (uint4) embedding shared with lm_head
        options.append("shared_embeddings=false")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(dest)]
    command += ["-p", step.precision, "-e", "cpu", "-c", str(cache)]
    if target_options:
        options_file = cache.parent / "target_options.json"
        options_file.write_text(json.dumps(target_options))
        command += ["--target_options", str(options_file)]
    command += ["--extra_options", *options]
    # GIT_DIR: the builder stamps `git rev-parse HEAD` of the folder above its install into the graph's
    # producer_version, which is this project when .venv lives in it: without this, every commit changed the bytes
    env = {**os.environ, "TQDM_DISABLE": "1", "GIT_DIR": os.devnull}
    failpoint("onnx_export")  # tests: stop with the staging folder made, before the builder writes into it
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise BuildError(f"onnx_genai: the model builder failed on {source}: {tail}")


def weight_bits(folder: Path) -> dict[str, int]:
    """The bits of every MatMulNBits node in an exported model.onnx, by node name without its _Q4/_Q8 suffix, and
    of a quantized embedding (GatherBlockQuantized)."""
    import onnx

    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    bits = {
        node.name.rsplit("_Q", 1)[0]: next(a.i for a in node.attribute if a.name == "bits")
        for node in graph.node
        if node.op_type == "MatMulNBits"
    }
    for node in graph.node:  # a quantized embedding table (int4 only; shared with the lm_head when tied)
        if node.op_type == "GatherBlockQuantized":
            bits[node.name] = next((a.i for a in node.attribute if a.name == "bits"), 4)
    return bits

"""onnx_genai step: export a float HF folder to ONNX Runtime GenAI with its model builder (int4/int8/fp32), after
an optional mixed-precision search (tasks/techniques/mixed_precision.py) and GPTQ rounding (tasks/techniques/gptq_rounding.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.engines.onnx.weights import write_weights
from tasks.errors import BuildError
from tasks.failpoints import failpoint
from tasks.schema import Former, Strict
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

PRECISION_BITS = {"fp32": 32, "int8": 8, "int4": 4}


class OnnxGenAIStep(Strict):
    """Export to ONNX Runtime GenAI with its model builder; int4/int8 are weight-only (MatMulNBits) block-wise."""

    RECORDED_DEFAULTS = frozenset({"precision", "block_size", "symmetric", "accuracy_level"})
    FORMER: ClassVar[dict[str, Former]] = {"gptq_windows": Former("calibration_windows")}
    precision: Literal["int4", "int8", "fp32"] = "int4"
    block_size: Literal[16, 32, 64, 128, 256] = 32
    symmetric: bool = True
    # ONNX Runtime's MatMulNBits compute type: 4 = int8 activations inside the int4/int8 MatMuls (VNNI kernels on
    # AVX-512 CPUs); 0 or 1 = float32 activations (most accurate); 2 / 3 = float16 / bfloat16. Always passed on: the
    # builder's own default on CPU is 4, whatever 0 would say
    accuracy_level: Literal[0, 1, 2, 3, 4] = 4
    mixed_precision: MixedPrecision | None = None  # int4 only: keep the most sensitive matrices at int8
    # int4 only: how weights are rounded. rtn: to nearest; gptq: GPTQ on the calibration split (symmetric only)
    rounding: Literal["rtn", "gptq"] = "rtn"
    # int4 only: each block's scale. absmax: onnxruntime's (the largest magnitude at level −8); weighted: the one
    # minimising the importance-weighted error (importance: each input's mean squared activation on the
    # calibration split, llama.cpp's importance matrix). Symmetric only
    scales: Literal["absmax", "weighted"] = "absmax"
    # int4 only: the lm_head's precision. For a tied model an int8 lm_head shares its table with the embedding
    # lookup (tasks/engines/onnx/weights.py). With mixed_precision, int4 lets the search decide it; int8 keeps it
    # at int8 from the start (its bytes come out of the size budget) and the search chooses the other matrices
    lm_head: Literal["int4", "int8"] = "int4"
    # rounding gptq or scales weighted: calibration windows (of 256 tokens) the statistics are collected on
    calibration_windows: Annotated[int, Field(ge=1, le=4096)] = 32

    @property
    def calibrated(self) -> bool:
        """Whether llmopt computes the int4 weights (and writes them into the graph) instead of the builder."""
        return self.rounding != "rtn" or self.scales != "absmax"

    @model_validator(mode="after")
    def _int4_options(self) -> OnnxGenAIStep:
        for name in ("mixed_precision", "rounding", "scales", "lm_head"):
            if name in self.model_fields_set and self.precision != "int4":
                raise ValueError(f"{name} applies to precision int4, not {self.precision}")
        if "calibration_windows" in self.model_fields_set and not self.calibrated:
            raise ValueError("calibration_windows applies only with rounding: gptq or scales: weighted")
        if self.calibrated and not self.symmetric:
            raise ValueError(
                "rounding: gptq and scales: weighted round onto the symmetric grid; leave symmetric at true"
            )
        return self


@register
class OnnxGenAI(Technique):
    name = "onnx_genai"
    settings = OnnxGenAIStep
    role = "export"
    engine_label = "ONNX Runtime GenAI"

    def export(self, model: Any, settings: OnnxGenAIStep, job: ExportJob) -> Exported:
        from tasks.engines.onnx import runtime as onnx_genai
        from tasks.engines.onnx.runtime import ONNX_GENAI

        export, context, notes = settings, job.context, []
        rounded = _calibrated_int4(model, export, context, notes) if export.calibrated else None
        shared = table_shareable(model, export)
        plan = (
            _mixed_precision_plan(model, export, context, rounded, shared) if export.mixed_precision else None
        )
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        options = plan.builder_options() if plan else _lm_head_options(export, tied)
        with tempfile.TemporaryDirectory(prefix="llmopt-export-") as scratch:
            source = (
                job.base_path
                if not job.changed
                else save_float_model(model, context.tokenizer, Path(scratch))
            )
            head8 = export.precision == "int8" or export.lm_head == "int8"
            head8 = head8 or bool(plan and "/lm_head/MatMul" in plan.int8_nodes)
            build_onnx_genai(source, job.dest, export, Path(scratch) / "builder-cache", options, not head8)
        int4 = _int4_weights(model, rounded, plan, export) if rounded else {}
        share = shared and head8  # the embedding lookup reads the int8 lm_head's table
        if int4 or share:
            write_weights(job.dest, int4, share_int8_lm_head=share)
        _check_weights_written(job.dest, int4)
        note = f"ONNX Runtime GenAI {export.precision}, block {export.block_size}, accuracy level {export.accuracy_level}"
        if export.lm_head == "int8":
            note += ", lm_head int8"
        if share:
            note += "; the embedding lookup reads the tied int8 lm_head's table"
        if plan:
            _check_plan_applied(plan, job.dest, shared)
            context.mixed_precision = plan.to_dict()
            note += f"; {plan.note()}"
        return Exported(ONNX_GENAI, onnx_genai.ENGINE, [*notes, note])

    def problems(
        self, where: str, settings: OnnxGenAIStep, config: ConfigView, cuda_available: bool
    ) -> list[str]:
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
                ("rounding", "calibration_windows"),
                "GPTQ on CPU: `calibration_windows` windows of 256 tokens give each matrix's input Hessian (every "
                "token scaled to unit length, so the attention-sink positions, whose activations are hundreds of "
                "times the others', do not dominate it); the levels and scales are written into the exported "
                "MatMulNBits nodes and read back (tested). The tied lm_head is rounded too (its table is the int4 "
                "embedding's). Symmetric int4 only",
            ),
            Row(
                "`onnx_genai: {precision: int4, scales: weighted}`",
                ("scales",),
                "each block's scale searched to minimise the importance-weighted squared error (importance: each "
                "input's mean squared activation on the calibration split, llama.cpp's importance matrix; its "
                "19 candidate grids): never worse than the builder's absmax scale on that error (tested), on "
                "SmolLM2 ×1.11 perplexity against ×1.33; with `rounding: gptq` GPTQ rounds onto those scales",
            ),
            Row(
                "`onnx_genai: {precision: int4, lm_head: int8}`",
                ("lm_head",),
                "the lm_head at int8 in an int4 export; for a tied model the embedding lookup reads the same int8 "
                "table (GatherBlockQuantized, 8 bits) instead of a float32 copy (also in int8 exports: SmolLM2's "
                "onnx_int8 loses 113 MB). With `mixed_precision` it stays at int8 from the start and the search chooses the other matrices (with `lm_head: int4` the search decides it too)",
            ),
            Row(
                "`onnx_genai: {precision: int4, mixed_precision: {…}}`",
                mixed,
                "accuracy-aware mixed precision: every matrix the export quantizes (a layer's fused q/k/v, o, "
                "gate, up, down, the lm_head) gets its loss cost at int4 and int8 from the empirical Fisher "
                "diagonal × the squared rounding error of onnxruntime's own grid (tested equal), scaled to the "
                "measured all-int4 loss; matrices are kept at int8 by loss saved per byte until the calibration "
                "perplexity increase fits the target or the bytes (share of an all-int8 export) are spent, each "
                "plan measured again. `sensitivity: measured` instead puts each decoder layer (and the lm_head, "
                "whose tied table the embedding lookup reads too) at int8 alone and measures what that saves on a "
                "quarter of the windows, then keeps whole layers. Calibration split only; the plan (per-matrix "
                "bits, predicted and measured increases) is in the manifest and the MLflow run, and the exported "
                "graph is checked to carry it",
            ),
        ]


def table_shareable(model: Any, export: OnnxGenAIStep) -> bool:
    """Whether the embedding lookup can read a tied int8 lm_head's table (GatherBlockQuantized): tied, symmetric
    (no zero points), and whole blocks per row."""
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    hidden = model.get_input_embeddings().weight.shape[1]
    return tied and export.symmetric and hidden % export.block_size == 0


def _mixed_precision_plan(
    model: Any, export: OnnxGenAIStep, context: Any, rounded: dict[str, Any] | None, shared: bool
) -> Any:
    """Which matrices the int4 export keeps at int8, searched on the calibration split (never the evaluation's),
    with each matrix at int4 as the export will store it (`rounded`: llmopt's own rounding, else the builder's)."""
    from tasks.techniques.mixed_precision import export_layer_of
    from tasks.techniques.mixed_precision_search import Goal, Grid, search

    settings = export.mixed_precision
    windows = context.sequences(context.tokenizer, settings.window_tokens, limit=settings.windows)
    int4 = {name: weights.dequantized() for name, weights in rounded.items()} if rounded else None
    with step_arguments("onnx_genai"):
        keep = frozenset({"/lm_head/MatMul"} if export.lm_head == "int8" else ())
        return search(
            model,
            windows,
            Goal(settings.target_ppl_increase, settings.size_budget, keep),
            Grid(export.block_size, export.symmetric, int4_weights=int4, shared_int8_table=shared),
            context.report,
            group=export_layer_of if settings.sensitivity in ("measured", "simulated") else None,
        )


def _calibrated_int4(model: Any, export: OnnxGenAIStep, context: Any, notes: list[str]) -> dict[str, Any]:
    """Every exported matrix's int4 weights (by torch module) from one calibration pass: GPTQ and/or weighted
    scales (tasks/techniques/gptq_rounding.py). The model is left as it was."""
    from tasks.techniques.gptq_rounding import round_matrices
    from tasks.techniques.mixed_precision import export_matrices

    windows = context.sequences(context.tokenizer, WINDOW_TOKENS, limit=export.calibration_windows)
    with step_arguments("onnx_genai"):
        matrices = export_matrices(model)
    modules = dict(model.named_modules())
    chosen = {name: modules[name] for m in matrices for name in m.modules}
    rounded = round_matrices(
        model, chosen, windows, export.block_size, export.rounding, export.scales, context.report
    )
    how = {"gptq": "GPTQ rounding", "rtn": "round-to-nearest"}[export.rounding]
    scales = "importance-weighted scales" if export.scales == "weighted" else "absmax scales"
    tokens = sum(len(ids) for ids in windows)
    notes.append(f"{how} with {scales} of {len(matrices)} matrices on {tokens:,} calibration tokens")
    return rounded


def _int4_weights(model: Any, rounded: dict[str, Any], plan: Any, export: OnnxGenAIStep) -> dict[str, Any]:
    """The int4 weights of every node the export stores at int4 (a fused node's modules' rows stacked)."""
    import torch

    from tasks.techniques.gptq_rounding import BlockwiseInt
    from tasks.techniques.mixed_precision import export_matrices

    int8 = set(plan.int8_nodes) if plan else {"/lm_head/MatMul"} if export.lm_head == "int8" else set()
    weights = {}
    for matrix in export_matrices(model):
        if matrix.node in int8:
            continue
        parts = [rounded[name] for name in matrix.modules]
        weights[matrix.node] = BlockwiseInt(
            torch.cat([p.levels for p in parts]), torch.cat([p.scales for p in parts]), parts[0].block
        )
    return weights


def _lm_head_options(export: OnnxGenAIStep, tied: bool) -> dict | None:
    """The builder's `--target_options` for an int8 `lm_head` in an int4 export."""
    from tasks.techniques.mixed_precision import int8_overrides

    return int8_overrides(["/lm_head/MatMul"], tied) if export.lm_head == "int8" else None


def _check_weights_written(dest: Path, int4: dict[str, Any]) -> None:
    """The exported graph holds exactly the levels and scales computed for every int4 node."""
    import torch

    from tasks.engines.onnx.weights import read_int4

    stored = read_int4(dest, list(int4)) if int4 else {}
    for node, planned in int4.items():
        held = stored[node]
        if not (
            torch.equal(held.levels, planned.levels) and torch.equal(held.scales, planned.scales.float())
        ):
            raise BuildError(
                f"onnx_genai: the exported {node} does not hold the rounded weights written into it"
            )


def _check_plan_applied(plan: Any, dest: Path, shared: bool) -> None:
    """The exported graph has int8 exactly where the plan put it (a builder that ignored an override is named)."""
    exported = weight_bits(dest)
    wanted = {choice.node: choice.bits for choice in plan.matrices}
    differing = [node for node, bits in wanted.items() if exported.get(node) != bits]
    embedding = "/model/embed_tokens/GatherBlockQuantized"
    head = wanted.get("/lm_head/MatMul")
    lookup = head if head == 4 or shared else None  # the lm_head's table, or (int8, unshareable) a float one
    if plan.tied_embeddings and exported.get(embedding) != lookup:
        differing = [embedding]
        wanted[embedding] = lookup
    if differing:
        raise BuildError(
            f"onnx_genai: the model builder did not apply the mixed-precision plan to {differing[0]} "
            f"(wanted {wanted[differing[0]]} bits, the graph has {exported.get(differing[0])})"
        )


def build_onnx_genai(
    source: Path,
    dest: Path,
    step: OnnxGenAIStep,
    cache: Path,
    target_options: dict | None = None,
    shared_embeddings: bool = True,
) -> None:
    """Run ONNX Runtime GenAI's model builder offline on an HF folder; its log is shown only if it fails.
    `target_options`: the builder's structured options (e.g. per-node weight types of a mixed-precision plan);
    `shared_embeddings`: false to keep the builder from sharing a tied table (onnx_weights.py shares an int8 one)."""
    options = [f"block_size={step.block_size}", f"is_symmetric={str(step.symmetric).lower()}"]
    options.append(f"accuracy_level={step.accuracy_level}")
    if not step.symmetric or not shared_embeddings:
        # builder 0.18 emits an invalid graph for an asymmetric (uint4) or an int8 embedding shared with lm_head
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

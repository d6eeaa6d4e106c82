"""The typed configuration: params.yaml validated once into a Config object."""

from __future__ import annotations

import difflib
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16"]


class Strict(BaseModel):
    """Base for every config section: unknown keys are refused, values are not coerced across types.

    Every default is declared here, once, on its field; code reads the field and never supplies a fallback.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    # Recipe sections only: fields written into the recipe (and its hash) even when left at their default. Every
    # other field enters the recipe only when params.yaml sets it, so a new setting (or a default made explicit
    # in code) changes no existing recipe hash. These lists are frozen: recipe hashes recorded in MLflow and the
    # registry depend on them.
    RECORDED_DEFAULTS: ClassVar[frozenset[str]] = frozenset()

    def recipe_data(self) -> dict[str, Any]:
        """What the user wrote in this section (plus its recorded defaults), as plain JSON data."""
        names = [n for n in type(self).model_fields if n in self.model_fields_set | self.RECORDED_DEFAULTS]
        return {name: _plain(getattr(self, name)) for name in names if getattr(self, name) is not None}


def _plain(value: Any) -> Any:
    if isinstance(value, Strict):
        return value.recipe_data()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


class ProjectConfig(Strict):
    name: str = Field("smollm2-135m-instruct", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    workdir: str = ".llmopt"
    downloads: str = ".llmopt/downloads"  # fetched inputs (`make corpus`), shared by every profile's workdir


class ModelConfig(Strict):
    source: str = Field("smollm2", min_length=1)
    revision: str | None = None


class DataConfig(Strict):
    source: str = Field("brown", min_length=1)
    text_column: str = "text"
    passage_words: Annotated[int, Field(ge=16, le=4096)] = 200
    min_passage_words: Annotated[int, Field(ge=1)] = 50
    calibration_passages: Annotated[int, Field(ge=1)] = 64
    evaluation_passages: Annotated[int, Field(ge=1)] = 32
    seed: int = 0

    @model_validator(mode="after")
    def _min_below_target(self) -> DataConfig:
        if self.min_passage_words > self.passage_words:
            raise ValueError("min_passage_words must not exceed passage_words")
        return self


class EvaluateConfig(Strict):
    window: Annotated[int, Field(ge=8, le=8192)] = 256
    max_tokens: Annotated[int, Field(ge=16)] = 4096
    agreement_prompts: Annotated[int, Field(ge=1)] = 8
    agreement_prompt_tokens: Annotated[int, Field(ge=1)] = 32
    agreement_new_tokens: Annotated[int, Field(ge=1)] = 32
    cloze_items: Annotated[int, Field(ge=1)] = 64
    cloze_context_words: Annotated[int, Field(ge=1)] = 64
    cloze_new_tokens: Annotated[int, Field(ge=1, le=64)] = 6
    lm_eval_tasks: list[
        Annotated[str, Field(min_length=1)]
    ] = []  # lm-evaluation-harness tasks (online users)
    lm_eval_limit: Annotated[int, Field(ge=1)] | None = 100  # examples per task (None: all)


class BenchmarkConfig(Strict):
    prompt_tokens: Annotated[int, Field(ge=1, le=8192)] = 128
    new_tokens: Annotated[int, Field(ge=2, le=4096)] = 32
    batch_sizes: Annotated[list[Annotated[int, Field(ge=1, le=256)]], Field(min_length=1)] = [1, 4, 8]
    ttft_prompt_tokens: Annotated[list[Annotated[int, Field(ge=1, le=8192)]], Field(min_length=1)] = [
        32,
        128,
        512,
    ]
    requests: Annotated[int, Field(ge=1, le=10_000)] = 10
    request_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 16
    warmup: Annotated[int, Field(ge=0)] = 1
    repeats: Annotated[int, Field(ge=1)] = 3

    @model_validator(mode="after")
    def _batch_one_measured(self) -> BenchmarkConfig:
        if 1 not in self.batch_sizes:
            raise ValueError("batch_sizes must include 1 (the latency a single user sees)")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError("batch_sizes must not repeat a size")
        return self


class TargetConfig(Strict):
    device: Literal["cpu", "cuda", "hpu"] = "cpu"
    threads: Annotated[int, Field(ge=1, le=1024)] = 2
    tensor_parallel: Annotated[int, Field(ge=1, le=64)] = 1  # DeepSpeed tensor-parallel degree (GPU targets)


class SelectConfig(Strict):
    baseline: str = "baseline"
    max_ppl_increase: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    confidence: Annotated[float, Field(gt=0.5, lt=1.0)] = 0.95
    bootstrap_resamples: Annotated[int, Field(ge=100, le=1_000_000)] = 2000
    seed: int = 0
    objective: Literal["latency", "throughput", "memory"] = "latency"
    # Constraints a winner must meet (None: no constraint).
    max_ttft_ms: Annotated[float, Field(gt=0)] | None = None
    max_rss_mb: Annotated[float, Field(gt=0)] | None = None
    max_size_mb: Annotated[float, Field(gt=0)] | None = None
    min_speedup: Annotated[float, Field(gt=0)] | None = None  # on the objective's speed, vs the baseline
    # Champion vs challenger: production moves only when the challenger's objective beats it by this share, at
    # `confidence`, over this many interleaved benchmark trials of the two.
    min_improvement: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    duel_trials: Annotated[int, Field(ge=1, le=20)] = 3
    # ... and only if its perplexity is not above production's by more than this share with confidence (smaller
    # differences are numerics: an fp32 model in another engine differs from its torch twin by ~1e-6)
    ppl_tolerance_vs_production: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005


QuantizeMethod = Literal[
    "torch_dynamic_int8",
    "torchao_int8_weight_only",
    "torchao_int8_dynamic",
    "torchao_int4_weight_only",
    "quanto_w8a16",
    "quanto_w4a16",
    "quanto_w8a8",
    "bnb_nf4",
    "bnb_fp4",
    "bnb_int8",
    "gptq",
]


class QuantizeStep(Strict):
    """Weight quantization; see tasks/techniques/quantize.py for what each method stores and runs."""

    method: QuantizeMethod
    # Method-specific settings; setting one that another method owns is refused.
    group_size: Literal[32, 64, 128, 192] = 64  # torchao_int4_weight_only, gptq (SmolLM2's 576 = 9 × 64)
    double_quant: bool = True  # bnb_nf4 / bnb_fp4: also quantize the scales
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bnb_nf4 / bnb_fp4 matmuls
    bits: Literal[2, 3, 4, 8] = 4  # gptq
    desc_act: bool = False  # gptq: quantize columns by decreasing activation order

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> QuantizeStep:
        owners = {
            "group_size": ("torchao_int4_weight_only", "gptq"),
            "double_quant": ("bnb_nf4", "bnb_fp4"),
            "compute_dtype": ("bnb_nf4", "bnb_fp4"),
            "bits": ("gptq",),
            "desc_act": ("gptq",),
        }
        for name in sorted(name for name in owners if name in self.model_fields_set):
            if self.method not in owners[name]:
                raise ValueError(f"{name} applies to {' / '.join(owners[name])}, not {self.method}")
        return self


class MixedPrecision(Strict):
    """int4 with the weight matrices that cost the most accuracy kept at int8, chosen on the calibration split
    (tasks/techniques/mixed_precision.py): until the calibration perplexity increase fits the target, or the bytes the
    budget allows are spent."""

    target_ppl_increase: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.02  # below the gate's budget
    size_budget: Annotated[float, Field(gt=0.0, le=1.0)] = 0.6  # share of the all-int8 matrices' bytes
    windows: Annotated[int, Field(ge=1, le=4096)] = 16  # calibration windows the search measures on ...
    window_tokens: Annotated[int, Field(ge=16, le=8192)] = 256  # ... of this many tokens


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
    # onto the same grid (symmetric only), which the builder then stores as is (tasks/techniques/gptq.py)
    rounding: Literal["rtn", "gptq"] = "rtn"

    @model_validator(mode="after")
    def _int4_options(self) -> OnnxGenAIStep:
        for name in ("mixed_precision", "rounding"):
            if name in self.model_fields_set and self.precision != "int4":
                raise ValueError(f"{name} applies to precision int4, not {self.precision}")
        if self.rounding == "gptq" and not self.symmetric:
            raise ValueError("rounding: gptq rounds onto the symmetric grid; leave symmetric at true")
        return self


GgufType = Literal[
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS", "shipped"
]


class LlamaCppStep(Strict):
    """Convert to GGUF with llama.cpp's converter and quantize with llama.cpp (tasks/techniques/gguf.py); the variant
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
        if self.mixed_precision is not None and self.type not in self.MIXABLE:
            raise ValueError(
                f"mixed_precision applies to type {' or '.join(self.MIXABLE)} (one 4-bit type for every matrix, "
                f"some kept at Q8_0), not {self.type}"
            )
        return self


class PruneStep(Strict):
    """Magnitude pruning: `unstructured` zeros weights (same size and speed without sparse kernels); `structured`
    removes MLP neurons / grouped-query attention groups, the same number in every layer (smaller matrices)."""

    method: Literal["unstructured", "structured"]
    sparsity: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5  # unstructured: share of weights zeroed
    scope: Literal["global", "layer"] = "global"  # unstructured: one threshold, or one per layer
    # structured: share of MLP neurons and number of KV groups (KV head + its queries) removed in every layer.
    # Both default to 0 (remove nothing) and at least one must be set: how much to cut is the user's call.
    mlp_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    head_groups: Annotated[int, Field(ge=0)] = 0
    importance: Literal["magnitude", "activation"] = (
        "activation"  # structured: activations on calibration text
    )
    heal_steps: Annotated[int, Field(ge=0, le=100_000)] = 0  # fine-tune on the calibration split afterwards
    heal_lr: Annotated[float, Field(gt=0.0, le=1.0)] = 5e-5

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> PruneStep:
        own = {
            "unstructured": ("sparsity", "scope"),
            "structured": ("mlp_fraction", "head_groups", "importance"),
        }
        other = "structured" if self.method == "unstructured" else "unstructured"
        foreign = [name for name in own[other] if name in self.model_fields_set]
        if foreign:
            raise ValueError(f"{foreign[0]} does not apply to method {self.method}")
        if self.method == "structured" and not (self.mlp_fraction or self.head_groups):
            raise ValueError("structured pruning needs mlp_fraction > 0 or head_groups > 0")
        return self


class DistillStep(Strict):
    """Knowledge distillation into a shallower student (every k-th layer kept), KL on teacher logits + CE."""

    RECORDED_DEFAULTS = frozenset(
        {"steps", "max_seconds", "lr", "temperature", "alpha", "batch_size", "sequence_tokens"}
        | {"checkpoint_every", "seed"}
    )
    keep_every: Annotated[int, Field(ge=2, le=64)] = 2  # keep layers 0, k, 2k, … and the last ...
    layers: Annotated[int, Field(ge=2)] | None = None  # ... or, when set, this many layers evenly spaced
    steps: Annotated[int, Field(ge=1, le=1_000_000)] = 200
    max_seconds: Annotated[float, Field(gt=0)] = 600.0  # wall-clock bound; a later run resumes the checkpoint
    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-4
    temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 2.0
    alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5  # weight of the KL term (1 - alpha on cross-entropy)
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 4
    sequence_tokens: Annotated[int, Field(ge=8, le=8192)] = (
        256  # calibration text cut into sequences this long
    )
    checkpoint_every: Annotated[int, Field(ge=1)] = 25
    seed: int = 0

    @model_validator(mode="after")
    def _one_depth_rule(self) -> DistillStep:
        if "keep_every" in self.model_fields_set and self.layers is not None:
            raise ValueError("set keep_every or layers, not both")
        return self

    def student_depth(self) -> tuple[int | None, int | None]:
        """(keep_every, layers) for `build_student`: exactly one of them is set."""
        return (None, self.layers) if self.layers is not None else (self.keep_every, None)


class Step(Strict):
    """One recipe step, written as a one-key mapping such as `{quantize: {method: torch_dynamic_int8}}`."""

    prune: PruneStep | None = None
    distill: DistillStep | None = None
    quantize: QuantizeStep | None = None
    onnx_genai: OnnxGenAIStep | None = None
    llama_cpp: LlamaCppStep | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Step:
        chosen = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError(f"a step names exactly one technique, got {chosen or 'none'}")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in type(self).model_fields if getattr(self, name) is not None)


class RuntimeSettings(Strict):
    """How the variant runs (not its weights). Everything but dtype applies to the torch engine only."""

    RECORDED_DEFAULTS = frozenset({"dtype"})
    dtype: Dtype = "float32"
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    kv_cache: Literal["dynamic", "static", "quantized"] = "dynamic"  # dynamic: grows with the text
    kv_cache_bits: Literal[2, 4] = 4  # kv_cache: quantized (quanto backend)
    sliding_window: Annotated[int, Field(ge=8)] | None = None  # attend to (and cache) only the last N tokens
    threads: Annotated[int, Field(ge=1, le=1024)] | None = None  # None: target.threads
    engine: Literal["torch", "deepspeed", "tensorrt_llm"] = "torch"  # torch: eager transformers

    @model_validator(mode="after")
    def _settings_agree(self) -> RuntimeSettings:
        if "kv_cache_bits" in self.model_fields_set and self.kv_cache != "quantized":
            raise ValueError("kv_cache_bits applies only with kv_cache: quantized")
        if self.sliding_window is not None and self.kv_cache == "static":
            raise ValueError("sliding_window bounds the cache itself; leave kv_cache at dynamic or quantized")
        return self

    def torch_only(self) -> list[str]:
        """Settings that the torch engines honour and ONNX Runtime GenAI does not."""
        names = ("attention", "kv_cache", "kv_cache_bits", "sliding_window", "engine")
        return [name for name in names if name in self.model_fields_set]


class VariantConfig(Strict):
    RECORDED_DEFAULTS = frozenset({"steps", "runtime"})
    steps: list[Step] = []
    runtime: RuntimeSettings = RuntimeSettings()

    @model_validator(mode="after")
    def _steps_compose(self) -> VariantConfig:
        kinds = [step.kind for step in self.steps]
        if kinds.count("quantize") > 1:
            raise ValueError("one quantize step per variant (weights cannot be quantized twice)")
        if "quantize" in kinds and any(k in ("prune", "distill") for k in kinds[kinds.index("quantize") :]):
            raise ValueError("prune and distill work on float weights; put them before quantize")
        if "quantize" in kinds and self.runtime.dtype != "float32":
            raise ValueError("quantize steps set their own compute precision; leave runtime.dtype at float32")
        for export, engine in (("onnx_genai", "ONNX Runtime GenAI"), ("llama_cpp", "llama.cpp")):
            if export not in kinds:
                continue
            if kinds.index(export) != len(kinds) - 1 or kinds.count(export) > 1:
                raise ValueError(f"{export} changes the engine and must be the last step")
            if "quantize" in kinds:
                raise ValueError(
                    f"{export} exports a float model; use its own precision instead of torch quantize"
                )
            if {"onnx_genai", "llama_cpp"} <= set(kinds):
                raise ValueError("onnx_genai and llama_cpp each export the model; a variant has one engine")
            if self.runtime.dtype != "float32":
                raise ValueError(f"{export} sets its own precision; leave runtime.dtype at float32")
            if self.runtime.torch_only():
                raise ValueError(
                    f"runtime.{self.runtime.torch_only()[0]} applies to the torch engine; {export} variants "
                    f"run in {engine} (only runtime.threads applies there)"
                )
        if self.peer and len(self.steps) > 1:
            raise ValueError("llama_cpp type shipped is the source's own GGUF; it takes no other steps")
        return self

    @property
    def peer(self) -> bool:
        """The source model's own GGUF as shipped: measured beside the variants, never selected or promoted."""
        return is_peer_recipe(self.recipe())

    def recipe(self) -> dict[str, Any]:
        """The recipe as the user wrote it, as plain data (see `Strict.RECORDED_DEFAULTS`)."""
        return self.recipe_data()

    def recipe_hash(self) -> str:
        """Content hash of the recipe: same recipe, same hash, whatever the variant is called."""
        canonical = json.dumps(self.recipe(), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()


def is_peer_recipe(recipe: dict[str, Any]) -> bool:
    """Whether a recorded recipe is the peer row (the source's own GGUF, `llama_cpp: {type: shipped}`)."""
    return any((step.get("llama_cpp") or {}).get("type") == "shipped" for step in recipe.get("steps", []))


class TrackingConfig(Strict):
    uri: str = "sqlite:///mlflow.db"
    artifacts: str = "mlruns"
    experiment: str = Field("llmopt", min_length=1)


class ServeConfig(Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    # What the server answers with, routed by the request's `model` field (the first answers requests naming
    # none): a registry alias of this project's model, `name@alias` of any registered model, or `name/version`.
    models: Annotated[
        list[Annotated[str, Field(pattern=r"^[\w.\-]+([@/][\w.\-]+)?$")]], Field(min_length=1)
    ] = ["production"]
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    # How often the server asks the registry where each alias points; a move is loaded, verified and swapped in
    # without dropping requests. 0: never (serve what was loaded at start).
    watch_s: Annotated[float, Field(ge=0, le=86_400)] = 10.0
    # Requests decoded together per model (iteration-level batching); 1 runs them one after another.
    max_batch: Annotated[int, Field(ge=1, le=64)] = 8
    # Requests waiting per model beyond the batch; more get 429 with Retry-After instead of an unbounded wait.
    max_queue: Annotated[int, Field(ge=1, le=10_000)] = 64
    request_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0  # queued + generating, then 504
    # Clients must send `Authorization: Bearer <key>` when this environment variable is set (and not empty).
    api_key_env: str = "LLMOPT_API_KEY"
    max_body_kb: Annotated[int, Field(ge=1, le=102_400)] = 1024  # larger request bodies get 413


class LoadtestConfig(Strict):
    """`llmopt loadtest`: the request set and concurrency levels it drives a running server with."""

    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] = [1, 4, 16]
    requests_per_level: Annotated[int, Field(ge=1, le=100_000)] = 48
    seed: int = 0
    prompt_words: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)] = [8, 160]
    max_tokens: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)] = [16, 64]

    @model_validator(mode="after")
    def _ranges_ascend(self) -> LoadtestConfig:
        for name in ("prompt_words", "max_tokens"):
            low, high = getattr(self, name)
            if low > high:
                raise ValueError(f"{name}: [low, high] with low <= high, got [{low}, {high}]")
        return self


class ScheduleConfig(Strict):
    """When `llmopt schedule` runs the pipeline (a Prefect deployment served against the Prefect server)."""

    cron: str | None = "0 3 * * *"  # nightly at 03:00 in the server's time zone (UTC unless configured)
    interval_s: Annotated[int, Field(ge=1)] | None = None  # instead of cron (then set cron: null): every N s
    deployment: str = Field("scheduled", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # a run still going after this many minutes is failed
    timeout_min: Annotated[float, Field(gt=0, le=7 * 24 * 60)] = 120.0
    # null: `llmopt schedule` serves the deployment from its own process. A name: the deployment is created on that
    # Prefect work pool (process type) and run by the pool's workers (`prefect worker start --pool NAME`, or
    # services.prefect_worker), on whichever machine they are
    work_pool: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")

    @model_validator(mode="after")
    def _one_schedule(self) -> ScheduleConfig:
        if (self.cron is None) == (self.interval_s is None):
            raise ValueError("set exactly one of cron and interval_s (cron: null to use an interval)")
        if self.cron is not None and len(self.cron.split()) != 5:
            raise ValueError(f"cron must have 5 fields (minute hour day month weekday), got {self.cron!r}")
        return self

    @property
    def when(self) -> dict[str, str | int]:
        """The schedule as Prefect's `serve` takes it: {"interval": s} or {"cron": expression}."""
        return {"interval": self.interval_s} if self.interval_s else {"cron": str(self.cron)}


class ServicesConfig(Strict):
    """Long-running services llmopt starts itself (`llmopt services up`): the Prefect server, for schedules."""

    # the Prefect UI and API: http://127.0.0.1:4200
    prefect_port: Annotated[int, Field(ge=1, le=65535)] = 4200
    # Prefect's own database: SQLite under project.workdir by default, or e.g.
    # postgresql+asyncpg://user:password@host:5432/prefect
    prefect_database_url: str | None = None
    # The tracking stack on this machine, started by `llmopt services up` beside the Prefect server: PostgreSQL
    # (MLflow's database), an S3 endpoint (moto, in memory: for tests and demos) and the MLflow tracking server
    # on both. Point llmopt at it with tracking.uri: http://127.0.0.1:<mlflow_port> and tracking.artifacts:
    # mlflow-artifacts:/llmopt. Off: MLflow runs embedded (sqlite:///mlflow.db + ./mlruns).
    tracking_stack: bool = False
    postgres_port: Annotated[int, Field(ge=1, le=65535)] = 5433
    s3_port: Annotated[int, Field(ge=1, le=65535)] = 5002
    mlflow_port: Annotated[int, Field(ge=1, le=65535)] = 5001
    # PostgreSQL's data folder (default project.workdir/services/postgres); as root it runs as the postgres user,
    # which must be able to reach this folder
    postgres_data: str | None = None
    # A Prefect worker on schedule.work_pool (runs the deployment's flow runs on this machine)
    prefect_worker: bool = False
    # A Dask scheduler on dask_port and this many workers (1 thread each; the first offers the `benchmark`
    # resource); 0: none. Point the pipeline at it with cluster.runner: dask, dask_address: tcp://127.0.0.1:<port>
    dask_workers: Annotated[int, Field(ge=0, le=256)] = 0
    dask_port: Annotated[int, Field(ge=1, le=65535)] = 8786


class ClusterConfig(Strict):
    """Where the pipeline's tasks run. `local`: in this process, one after another. `dask`: builds and evaluations
    fan out over a Dask cluster (a local one of `dask_workers` processes, or the scheduler at `dask_address`);
    benchmarks wait until nothing else runs, then run one at a time on workers offering the `benchmark` resource."""

    runner: Literal["local", "dask"] = "local"
    dask_address: str | None = Field(None, pattern=r"^(tcp|tls|inproc|ucx)://\S+$")
    dask_workers: Annotated[int, Field(ge=1, le=256)] = 2  # processes of the local cluster, 1 thread each
    # Shared store for the bytes tasks exchange (base model, data splits, variants), content-addressed and checked
    # on every read: s3://bucket/prefix (endpoint and keys from the AWS_* environment) or a folder every worker
    # mounts. null: workers use the paths of this machine's project.workdir (a local cluster, or a shared mount).
    store: str | None = None
    # Where workers keep their copies of stored folders (~ expands on the worker)
    worker_dir: str = "~/.cache/llmopt/worker"

    @model_validator(mode="after")
    def _address_for_dask(self) -> ClusterConfig:
        if self.runner == "local" and self.dask_address is not None:
            raise ValueError("dask_address is set but runner is local (set runner: dask to use the cluster)")
        return self


class Config(Strict):
    project: ProjectConfig = ProjectConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    target: TargetConfig = TargetConfig()
    select: SelectConfig = SelectConfig()
    variants: dict[str, VariantConfig] = Field(min_length=1)
    tracking: TrackingConfig = TrackingConfig()
    serve: ServeConfig = ServeConfig()
    loadtest: LoadtestConfig = LoadtestConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    services: ServicesConfig = ServicesConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _baseline_is_plain(self) -> Config:
        base = self.variants.get(self.select.baseline)
        if base is None:
            raise ValueError(f"select.baseline names {self.select.baseline!r}, which is not in variants")
        if base.steps or base.runtime.dtype != "float32":
            raise ValueError(f"the baseline variant {self.select.baseline!r} must be fp32 with no steps")
        if self.services.prefect_worker and self.schedule.work_pool is None:
            raise ValueError("services.prefect_worker needs schedule.work_pool (the pool the worker runs)")
        return self


def load_config(path: Path) -> Config:
    """Read and validate params.yaml; every problem becomes one ConfigError line naming the key path."""
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of sections, got {type(raw).__name__}")
    if "extends" in raw:
        raw = _extend(path, raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(path.name, exc)) from None


def _extend(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A profile file: `extends: params.yaml` plus the sections it changes (keys merged into the base's sections;
    variants added to, or replacing, the base's variants by name)."""
    base_path = path.parent / str(raw.pop("extends"))
    if base_path.resolve() == path.resolve():
        raise ConfigError(f"{path}: extends: names the file itself")
    base = yaml.safe_load(base_path.read_text()) if base_path.is_file() else None
    if not isinstance(base, dict) or "extends" in base:
        raise ConfigError(f"{path}: extends: {base_path} must be a plain params file (one level of extends)")
    for section, values in raw.items():
        merged = isinstance(values, dict) and isinstance(base.get(section), dict)
        base[section] = {**base[section], **values} if merged else values
    return base


def describe_validation_error(source: str, exc: ValidationError) -> str:
    """One line for the first validation problem, with the dotted key path and what was expected."""
    errors = exc.errors()
    first = errors[0]
    loc = [part for part in first["loc"] if not _is_pydantic_branch(part)]
    key = _format_loc(loc)
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        detail = (
            f"unknown key{f' (did you mean {hint[0]!r}?)' if hint else ''}; allowed: {', '.join(allowed)}"
        )
    else:
        got = first.get("input")
        detail = f"{first['msg'].removeprefix('Value error, ')}"
        if first["type"] not in ("missing", "value_error") and not isinstance(got, dict):
            detail += f", got {got!r}"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {key or '<top level>'}: {detail}{more}"


def _is_pydantic_branch(part: Any) -> bool:
    """Union/literal branch labels pydantic inserts into error locations (e.g. 'function-after[...]')."""
    return isinstance(part, str) and (
        "[" in part or part in ("QuantizeStep", "Step", "PruneStep", "DistillStep")
    )


def _format_loc(loc: list[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _allowed_keys(loc: list[Any]) -> list[str]:
    """Field names of the config section found by walking `loc` from Config (dict keys and indexes skipped)."""
    current: Any = Config
    for part in loc:
        if isinstance(part, int):
            current = _unwrap(current, list)
        elif isinstance(current, type) and issubclass(current, BaseModel):
            current = current.model_fields[part].annotation
        else:
            current = _unwrap(current, dict)
    current = _unwrap(current, None)
    return (
        sorted(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []
    )


def _unwrap(annotation: Any, container: type | None) -> Any:
    """The model type inside `list[X]`, `dict[str, X]` or `X | None`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if container is not None and origin is container:
        return args[-1]
    if origin in (typing.Union, types.UnionType):
        return next(arg for arg in args if arg is not type(None))
    return annotation

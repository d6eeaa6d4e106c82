"""The typed configuration: params.yaml validated once into a Config object."""

from __future__ import annotations

import difflib
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16"]


class Strict(BaseModel):
    """Base for every config section: unknown keys are refused, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ProjectConfig(Strict):
    name: str = Field("smollm2-135m-instruct", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    workdir: str = ".llmopt"


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


class BenchmarkConfig(Strict):
    prompt_tokens: Annotated[int, Field(ge=1, le=8192)] = 128
    new_tokens: Annotated[int, Field(ge=2, le=4096)] = 32
    batch_sizes: Annotated[list[Annotated[int, Field(ge=1, le=256)]], Field(min_length=1)] = [1, 4, 8]
    ttft_prompt_tokens: Annotated[list[Annotated[int, Field(ge=1, le=8192)]], Field(min_length=1)] = [
        32,
        128,
        512,
    ]
    requests: Annotated[int, Field(ge=1, le=10_000)] = 12
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
    device: Literal["cpu"] = "cpu"
    threads: Annotated[int, Field(ge=1, le=1024)] = 2


class SelectConfig(Strict):
    baseline: str = "baseline"
    max_ppl_increase: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    confidence: Annotated[float, Field(gt=0.5, lt=1.0)] = 0.95
    bootstrap_resamples: Annotated[int, Field(ge=100, le=1_000_000)] = 2000
    seed: int = 0


class QuantizeStep(Strict):
    method: Literal["torch_dynamic_int8"]


class OnnxGenAIStep(Strict):
    """Export to ONNX Runtime GenAI with its model builder; int4/int8 are weight-only (MatMulNBits) block-wise."""

    precision: Literal["int4", "int8", "fp32"] = "int4"
    block_size: Literal[16, 32, 64, 128, 256] = 32
    symmetric: bool = True
    # 4 = int8 activations inside the int4/int8 MatMuls (VNNI kernels on AVX-512 CPUs); 0 = builder default.
    accuracy_level: Literal[0, 1, 2, 3, 4] = 4


class Step(Strict):
    """One recipe step, written as a one-key mapping such as `{quantize: {method: torch_dynamic_int8}}`."""

    quantize: QuantizeStep | None = None
    onnx_genai: OnnxGenAIStep | None = None

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
    dtype: Dtype = "float32"


class VariantConfig(Strict):
    steps: list[Step] = []
    runtime: RuntimeSettings = RuntimeSettings()

    @model_validator(mode="after")
    def _steps_compose(self) -> VariantConfig:
        kinds = [step.kind for step in self.steps]
        if "quantize" in kinds and self.runtime.dtype != "float32":
            raise ValueError("torch_dynamic_int8 computes in float32; set runtime.dtype: float32")
        if "onnx_genai" in kinds:
            if kinds.index("onnx_genai") != len(kinds) - 1:
                raise ValueError("onnx_genai changes the engine and must be the last step")
            if "quantize" in kinds:
                raise ValueError(
                    "onnx_genai exports a float model; use its own precision instead of torch quantize"
                )
            if self.runtime.dtype != "float32":
                raise ValueError("onnx_genai sets its own precision; leave runtime.dtype at float32")
        return self

    def recipe(self) -> dict[str, Any]:
        """The recipe as plain data, unset step kinds left out (adding a technique changes no existing hash)."""
        return self.model_dump(mode="json", exclude_none=True)

    def recipe_hash(self) -> str:
        """Content hash of the recipe: same recipe, same hash, whatever the variant is called."""
        canonical = json.dumps(self.recipe(), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()


class TrackingConfig(Strict):
    uri: str = "sqlite:///mlflow.db"
    artifacts: str = "mlruns"
    experiment: str = Field("llmopt", min_length=1)


class ServeConfig(Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    alias: str = "production"
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64


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

    @model_validator(mode="after")
    def _baseline_is_plain(self) -> Config:
        base = self.variants.get(self.select.baseline)
        if base is None:
            raise ValueError(f"select.baseline names {self.select.baseline!r}, which is not in variants")
        if base.steps or base.runtime.dtype != "float32":
            raise ValueError(f"the baseline variant {self.select.baseline!r} must be fp32 with no steps")
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
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(path.name, exc)) from None


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
    return isinstance(part, str) and ("[" in part or part in ("QuantizeStep", "Step"))


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

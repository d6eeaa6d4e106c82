"""params.yaml as one typed object (`Config`): the sections of tasks/config.py and the variants' recipes, whose
step schema (`Step`: one field per registered technique) is assembled here from the technique registry. Built once
per process, on first import (plug-in techniques load before it: tasks/techniques/catalog.py)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, create_model, model_validator

from tasks.config import (
    BenchmarkConfig,
    ClusterConfig,
    DataConfig,
    EvaluateConfig,
    LoadtestConfig,
    LongContextConfig,
    ModelConfig,
    ProjectConfig,
    RuntimeSettings,
    ScheduleConfig,
    SelectConfig,
    ServeConfig,
    ServicesConfig,
    SloConfig,
    TargetConfig,
    TrackingConfig,
)
from tasks.config_serving import LLAMA_STREAM_TOKENS
from tasks.schema import Strict
from tasks.search.settings import SearchConfig
from tasks.techniques import catalog, registry


class StepBase(Strict):
    """One recipe step, written as a one-key mapping such as `{quantize: {method: torch_dynamic_int8}}`: one field
    per registered technique (tasks/techniques/registry.py), exactly one of them set."""

    @model_validator(mode="after")
    def _exactly_one(self) -> StepBase:
        chosen = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError(f"a step names exactly one technique, got {chosen or 'none'}")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in type(self).model_fields if getattr(self, name) is not None)

    @property
    def settings(self) -> Strict:
        """The chosen technique's settings."""
        return getattr(self, self.kind)

    @property
    def technique(self) -> registry.Technique:
        return registry.technique(self.kind)


Step = create_model(
    "Step",
    __base__=StepBase,
    __module__=__name__,
    **{name: (entry.settings | None, None) for name, entry in catalog.load().items()},
)


class VariantConfig(Strict):
    RECORDED_DEFAULTS = frozenset({"steps", "runtime"})
    steps: list[Step] = []
    runtime: RuntimeSettings = RuntimeSettings()

    @model_validator(mode="after")
    def _steps_compose(self) -> VariantConfig:
        kinds = [step.kind for step in self.steps]
        roles = [step.technique.role for step in self.steps]
        transforms, exports = registry.of_role("transform"), registry.of_role("export")
        if roles.count("quantize") > 1:
            raise ValueError("one quantize step per variant (weights cannot be quantized twice)")
        if "quantize" in roles:
            quantize = kinds[roles.index("quantize")]
            if "transform" in roles[roles.index("quantize") :]:
                raise ValueError(f"{_and(transforms)} work on float weights; put them before {quantize}")
            if self.runtime.dtype != "float32":
                raise ValueError(
                    f"{quantize} steps set their own compute precision; leave runtime.dtype at float32"
                )
        for export in (name for name in exports if name in kinds):
            engine = registry.technique(export).engine_label
            if kinds.index(export) != len(kinds) - 1 or kinds.count(export) > 1:
                raise ValueError(f"{export} changes the engine and must be the last step")
            if "quantize" in roles:
                raise ValueError(
                    f"{export} exports a float model; use its own precision instead of torch {kinds[roles.index('quantize')]}"
                )
            if roles.count("export") > 1:
                present = [name for name in exports if name in kinds]
                raise ValueError(f"{_and(present)} each export the model; a variant has one engine")
            if self.runtime.dtype != "float32":
                raise ValueError(f"{export} sets its own precision; leave runtime.dtype at float32")
            if self.runtime.torch_only():
                raise ValueError(
                    f"runtime.{self.runtime.torch_only()[0]} applies to the torch engine; {export} variants "
                    f"run in {engine} (only runtime.threads applies there)"
                )
        if self.runtime.kv_cache_type != "f16" and "llama_cpp" not in kinds:
            raise ValueError(
                "runtime.kv_cache_type is llama.cpp's KV cache type (a llama_cpp variant's); the torch engine "
                "quantizes its cache with kv_cache: quantized"
            )
        if self.peer and len(self.steps) > 1:
            peer = next(step.kind for step in self.steps if not step.technique.needs_model(step.settings))
            raise ValueError(f"{peer} {registry.technique(peer).peer_note}; it takes no other steps")
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
    """Whether a recorded recipe is the peer row (the source's own model as shipped, `llama_cpp: {type: shipped}`):
    a step that needs no float model."""
    for step in recipe.get("steps", []):
        for name, settings in step.items():
            read = registry.recorded_settings(name, settings)
            if read is not None and not read[0].needs_model(read[1]):
                return True
    return False


def _and(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


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
    slo: SloConfig | None = (
        None  # the service-level objective of the load test and of select.objective: serving
    )
    schedule: ScheduleConfig = ScheduleConfig()
    services: ServicesConfig = ServicesConfig()
    cluster: ClusterConfig = ClusterConfig()
    search: SearchConfig = SearchConfig()  # `llmopt search` (docs/search.md)
    long_context: LongContextConfig | None = (
        None  # accuracy at long context (docs/long-context.md); off: absent
    )

    @model_validator(mode="before")
    @classmethod
    def _slo_moved(cls, data: Any) -> Any:
        """`loadtest.slo` (its former place) is read as the top-level `slo` (tasks.params_file says so)."""
        loadtest = data.get("loadtest") if isinstance(data, dict) else None
        if not isinstance(loadtest, dict) or "slo" not in loadtest:
            return data
        if data.get("slo") is not None and loadtest["slo"] is not None:
            raise ValueError("loadtest.slo is the former place of slo; set only the top-level slo")
        data = {**data, "loadtest": {k: v for k, v in loadtest.items() if k != "slo"}}
        if data.get("slo") is None:
            data["slo"] = loadtest["slo"]
        return data

    @model_validator(mode="after")
    def _baseline_is_plain(self) -> Config:
        base = self.variants.get(self.select.baseline)
        if base is None:
            raise ValueError(f"select.baseline names {self.select.baseline!r}, which is not in variants")
        if base.steps or base.runtime.dtype != "float32" or base.runtime.speculative is not None:
            raise ValueError(
                f"the baseline variant {self.select.baseline!r} must be fp32 with no steps and no speculation"
            )
        for name, variant in self.variants.items():
            speculative = variant.runtime.speculative
            if speculative is None or speculative.draft is None:
                continue
            draft = self.variants.get(speculative.draft)
            if draft is None or speculative.draft == name:
                raise ValueError(
                    f"variants.{name}.runtime.speculative.draft names {speculative.draft!r}, which is not "
                    "another variant of params.yaml"
                )
            if draft.runtime.speculative is not None:
                raise ValueError(
                    f"variants.{name}.runtime.speculative.draft: {speculative.draft} speculates itself; a draft "
                    "proposes with plain decoding"
                )
        if self.loadtest.prompt_source == "long_documents" and self.long_context is None:
            raise ValueError(
                "loadtest.prompt_source: long_documents draws prompts from long_context's documents: set it"
            )
        if self.benchmark.served_lengths and (self.long_context is None or self.slo is None):
            raise ValueError(
                "benchmark.served_lengths cuts prompts from long_context's documents and counts the clients meeting "
                "the slo: set both"
            )
        if self.benchmark.served_lengths:
            self._served_lengths_fit()
        if self.select.objective == "serving" and not self.benchmark.served_clients:
            raise ValueError(
                "select.objective: serving ranks by served capacity: benchmark.served_clients must not be empty"
            )
        if self.select.max_gpu_mb is not None and not self.target.device.startswith("cuda"):
            raise ValueError(
                f"select.max_gpu_mb bounds GPU memory, which a {self.target.device} target does not use; "
                "use max_rss_mb"
            )
        leader = self.variants.get(self.search.leader) if self.search.leader is not None else None
        if self.search.leader is not None and (leader is None or leader.peer):
            what = (
                "a peer row (measured beside, never selected)" if leader else "not a variant of params.yaml"
            )
            raise ValueError(f"search.leader names {self.search.leader!r}, {what}")
        if self.services.prefect_worker and self.schedule.work_pool is None:
            raise ValueError("services.prefect_worker needs schedule.work_pool (the pool the worker runs)")
        return self

    def _served_lengths_fit(self) -> None:
        """Each served length holds an answer, fits the documents and one request's room in every engine."""
        lengths, answer = self.benchmark.served_lengths, self.loadtest.max_tokens[1]
        room = self.serve.sequence_tokens
        gguf = any(step.kind == "llama_cpp" for v in self.variants.values() for step in v.steps)
        if min(lengths) <= answer:
            raise ValueError(
                f"benchmark.served_lengths: each window holds a prompt and an answer of up to "
                f"loadtest.max_tokens[1] = {answer} tokens; got {min(lengths)}"
            )
        if self.long_context is not None and max(lengths) > self.long_context.longest:
            raise ValueError(
                f"benchmark.served_lengths: {max(lengths)} tokens, over long_context's longest window "
                f"({self.long_context.longest}), which is all its documents are chosen to hold"
            )
        if max(lengths) > (room or (LLAMA_STREAM_TOKENS if gguf else max(lengths))):
            raise ValueError(
                f"benchmark.served_lengths: {max(lengths)} tokens, over one request's room in the server "
                f"(serve.sequence_tokens: {room or f'{LLAMA_STREAM_TOKENS} for llama.cpp variants'}): raise it"
            )

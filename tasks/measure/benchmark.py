"""benchmark: speed and memory of one variant on the target, each variant in a fresh process.

A fresh process per variant (tasks/measure/processes.py) makes peak memory honest (no allocator reuse from the
previous variant) and keeps one variant's caches from warming the next. TTFT is the latency of the prompt's
first token (prefill + first pick), inside the timed decode call where the engine reports it, else from a
one-token call; decode speed is batch × (N - 1) / (time for N tokens - TTFT), medians over the repeats, for each
configured batch size; end-to-end latency percentiles come from a fixed, seeded request set (prompt lengths
spread over the TTFT lengths) served one request at a time. Every run goes through the Runtime that evaluation
and serving use.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.config import BenchmarkConfig, TargetConfig
from tasks.engines import Runtime, load_runtime
from tasks.failpoints import failpoint
from tasks.measure.long_context import LengthSpeed, speed_at_lengths
from tasks.measure.processes import peak_rss_mb as process_peak_mb
from tasks.measure.processes import reset_peak_rss, rss_mb
from tasks.measure.sampling import median_interval, repeat_to_length
from tasks.measure.served import LevelResult, ServedPlan, served_capacity
from tasks.measure.served_lengths import LengthCapacity, capacity_by_length, capacity_from_dict
from tasks.measure.speculation import StyleSpeed, measure_speculation


@dataclass(frozen=True)
class BatchSpeed:
    batch_size: int
    ttft_ms: float  # the whole batch's first tokens (prefill of batch × prompt tokens)
    decode_tok_s: float  # aggregate: batch × tokens after the first, per second
    tpot_ms: float  # time per output token of one sequence (one decode step of the batch)
    decode_tok_s_runs: list[float]
    ttft_ms_runs: list[float]


@dataclass(frozen=True)
class BenchmarkResult:
    load_s: float
    ttft_ms: float  # batch 1, `prompt_tokens` prompt
    ttft_ms_runs: list[float]
    decode_tok_s: float  # batch 1
    decode_tok_s_runs: list[float]
    decode_tok_s_ci: tuple[float, float]  # distribution-free interval for the batch-1 median ...
    decode_ci_coverage: (
        float  # ... and its exact coverage (min–max of 3 runs covers the median 75 % of the time)
    )
    batches: list[BatchSpeed]
    ttft_ms_by_prompt: dict[int, float]  # prompt tokens → median TTFT at batch 1
    latency_ms: dict[str, float]  # p50/p95/p99 end-to-end latency over the fixed request set
    latency_ms_runs: list[float]
    prompt_tokens: int
    new_tokens: int
    weight_bytes: int  # bytes of weight files on disk
    decode_read_bytes: int  # of which a batch-1 decode step reads (an untied embedding table only one row)
    peak_rss_mb: float
    process_rss_before_load_mb: float
    threads: int
    # the GPU's high-water allocated memory from load to the end (a cuda target; None on the CPU)
    peak_gpu_mb: float | None = None
    # the first generate call, untimed elsewhere: where compiling (compile: true) and kernel choice land; a new
    # batch size compiles again inside its own warm-up, outside every timing
    first_call_s: float = 0.0
    # seconds the runtime spent compiling (llmopt's compiled decode loop on cuda: each bucket's first step; None:
    # nothing compiled), also inside first_call_s and the warm-ups, never inside a timing
    compile_s: float | None = None
    # the short benchmark of a variant outside the accuracy budget (BenchmarkConfig.short)
    short: bool = False
    # a speculative variant: each prompt style with and without speculation (tasks/measure/speculation.py)
    speculation: list[StyleSpeed] | None = None
    # served capacity at each of benchmark.served_clients (tasks/measure/served.py), after everything above and
    # outside peak_rss_mb (the serving decoder's KV rows are the server's memory, not the variant's at batch 1);
    # None: not measured (outside the accuracy budget, the peer row, or served_clients empty)
    served: list[LevelResult] | None = None
    served_peak_rss_mb: float | None = None
    long_context: list[LengthSpeed] | None = None  # at benchmark.long_prompt_tokens, after everything above
    # served capacity by window length (benchmark.served_lengths), last; None: not measured (as `served`)
    served_by_length: list[LengthCapacity] | None = None


WEIGHT_SUFFIXES = (".safetensors", ".onnx", ".onnx.data", ".data", ".pt", ".bin", ".gguf")
EMBEDDING_TABLES = ("embed_tokens.weight", "token_embd.weight")  # Hugging Face / ONNX names, GGUF's


def decode_rate(new_tokens: int, total_s: float, ttft_s: float, batch_size: int = 1) -> float:
    """Tokens per second after the first token, all sequences of the batch together; the first token's cost
    belongs to TTFT."""
    return batch_size * (new_tokens - 1) / max(total_s - ttft_s, 1e-9)


def measure(
    runtime: Runtime, prompts: list[list[int]], new_tokens: int, warmup: int, repeats: int
) -> tuple[list[float], list[float]]:
    """(TTFT seconds per repeat, total seconds for `new_tokens` per repeat) of one batch, after warm-up runs. TTFT
    is read from the timed call itself where the engine reports its first tokens (`Runtime.first_token_s`: the
    same prefill, no second one per repeat); otherwise a one-token call of its own is timed."""
    # a few tokens settle allocation and kernel choice for these shapes; a compiled variant warms up at the full
    # length, so its static cache (and graph) has the timed runs' shape before any timing
    warm_tokens = new_tokens if getattr(runtime, "compiled", False) else min(new_tokens, 4)
    for _ in range(warmup):
        runtime.generate(prompts, warm_tokens, stop_at_eos=False)
    ttft, total = [], []
    for _ in range(repeats):
        total.append(_timed(lambda: runtime.generate(prompts, new_tokens, stop_at_eos=False)))
        first = getattr(runtime, "first_token_s", None)
        ttft.append(
            first if first is not None else _timed(lambda: runtime.generate(prompts, 1, stop_at_eos=False))
        )
    return ttft, total


def batch_speed(runtime: Runtime, prompt: list[int], batch_size: int, cfg: BenchmarkConfig) -> BatchSpeed:
    """Decode speed with `batch_size` copies of the prompt generated together."""
    ttft, total = measure(runtime, [prompt] * batch_size, cfg.new_tokens, cfg.warmup, cfg.repeats)
    median_ttft, median_total = statistics.median(ttft), statistics.median(total)
    return BatchSpeed(
        batch_size=batch_size,
        ttft_ms=median_ttft * 1000,
        decode_tok_s=decode_rate(cfg.new_tokens, median_total, median_ttft, batch_size),
        tpot_ms=(median_total - median_ttft) / (cfg.new_tokens - 1) * 1000,
        decode_tok_s_runs=[
            decode_rate(cfg.new_tokens, t, f, batch_size) for t, f in zip(total, ttft, strict=True)
        ],
        ttft_ms_runs=[t * 1000 for t in ttft],
    )


def ttft_by_prompt_length(runtime: Runtime, ids: list[int], lengths: list[int], cfg: BenchmarkConfig) -> dict:
    """Median time to the first token at batch 1 for prompts of each length."""
    result = {}
    for length in lengths:
        prompt = repeat_to_length(ids, length)
        for _ in range(cfg.warmup):
            runtime.generate([prompt], 1, stop_at_eos=False)
        runs = [
            _timed(lambda p=prompt: runtime.generate([p], 1, stop_at_eos=False)) for _ in range(cfg.repeats)
        ]
        result[length] = statistics.median(runs) * 1000
    return result


def request_latencies(runtime: Runtime, requests: list[list[int]], new_tokens: int) -> list[float]:
    """End-to-end milliseconds of each request of the fixed set, served one after another at batch 1."""
    return [_timed(lambda r=r: runtime.generate([r], new_tokens, stop_at_eos=False)) * 1000 for r in requests]


def request_set(
    ids: list[int], count: int, min_tokens: int, max_tokens: int, seed: int = 0
) -> list[list[int]]:
    """A fixed, seeded set of prompts with lengths spread between min and max tokens (same for every variant)."""
    import random

    rng = random.Random(seed)
    return [
        repeat_to_length(ids[rng.randrange(len(ids)) :] or ids, rng.randint(min_tokens, max_tokens))
        for _ in range(count)
    ]


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)}


def weight_bytes(folder: Path) -> int:
    return sum(
        f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)
    )


def decode_read_bytes(folder: Path, device: str = "cpu") -> int:
    """Weight bytes one batch-1 decode step reads: every weight file, less an input-embedding table stored apart
    from the output projection (a step reads one row of it; a tied table is read whole by the output layer).
    Matrices quantized when loaded count as packed on the device, not as stored."""
    import json

    from tasks.weights.on_load import ON_LOAD_FILE

    tensors = stored_tensor_bytes(folder)
    embeddings = sum(size for name, size in tensors.items() if name.endswith(EMBEDDING_TABLES))
    untied = any("lm_head" in name or name == "output.weight" for name in tensors)  # GGUF: output.weight
    on_load = folder / ON_LOAD_FILE
    packed_by_device = json.loads(on_load.read_text())["packed_bytes"] if on_load.is_file() else {}
    packed = packed_by_device.get(device.partition(":")[0], {})
    shrunk = sum(tensors[name] - size for name, size in packed.items() if name in tensors)
    return weight_bytes(folder) - shrunk - (embeddings if untied else 0)


def stored_tensor_bytes(folder: Path) -> dict[str, int]:
    """Name → bytes of the tensors in a variant's safetensors, ONNX, torch and GGUF files (headers only where
    possible)."""
    import json

    tensors: dict[str, int] = {}
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        tensors.update(
            {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
        )
    for path in folder.glob("*.onnx"):
        import onnx
        from onnx import helper

        graph = onnx.load(str(path), load_external_data=False).graph
        for init in graph.initializer:
            itemsize = helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
            tensors[init.name] = int(math.prod(init.dims)) * itemsize
    for path in folder.glob("*.pt"):
        import torch

        state = torch.load(path, mmap=True, weights_only=True)
        tensors.update(
            {k: v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        )
    for path in folder.glob("*.gguf"):
        from gguf import GGUFReader

        tensors.update({t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors})
    return tensors


def benchmark_variant(
    folder: Path,
    cfg: BenchmarkConfig,
    prompt_text: str,
    target: TargetConfig,
    served: ServedPlan | None = None,
) -> BenchmarkResult:
    """Load the variant on the `target` and measure TTFT, decode speed per batch size and latency over the request
    set (every timed call returns token ids to the host, so a GPU's queued work is inside the timing); with a
    `served` plan, then its served capacity at each of `cfg.served_clients`."""
    rss_before, device = rss_mb(), target.device
    gpu = device.startswith("cuda")
    if gpu:
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    runtime = load_runtime(folder, target)
    load_s = time.perf_counter() - start
    ids = runtime.encode(prompt_text)
    if not ids:
        raise ValueError("benchmark prompt text tokenizes to nothing")
    prompt = repeat_to_length(ids, cfg.prompt_tokens)
    first_call_s = _timed(lambda: runtime.generate([prompt], min(cfg.new_tokens, 4), stop_at_eos=False))
    batches = [batch_speed(runtime, prompt, size, cfg) for size in cfg.batch_sizes]
    single = next(b for b in batches if b.batch_size == 1)
    requests = request_set(ids, cfg.requests, min(cfg.ttft_prompt_tokens), max(cfg.ttft_prompt_tokens))
    if getattr(runtime, "compiled", False):  # every request's shape compiled before the timed pass
        request_latencies(runtime, requests, cfg.request_new_tokens)
    latencies = request_latencies(runtime, requests, cfg.request_new_tokens)
    low, high, coverage = median_interval(single.decode_tok_s_runs)
    speculation = None
    if runtime.speculation is not None:
        speculation = measure_speculation(
            runtime, ids, cfg.prompt_tokens, cfg.new_tokens, cfg.warmup, cfg.repeats
        )
    peak_rss_mb = process_peak_mb()
    peak_gpu_mb = torch.cuda.max_memory_allocated(device) / 2**20 if gpu else None
    levels = None
    if served is not None and cfg.served_clients:
        levels = served_capacity(runtime, served, cfg.served_clients)
    served_peak = process_peak_mb() if levels is not None else None
    at_length = (
        speed_at_lengths(runtime, ids, cfg.long_prompt_tokens, process_peak_mb, reset_peak_rss) or None
    )
    by_length = None
    if served is not None and served.lengths and cfg.served_lengths:
        alone = {s.length: s.ttft_ms for s in at_length or ()}
        by_length = capacity_by_length(runtime, served, process_peak_mb, reset_peak_rss, alone)
    return BenchmarkResult(
        load_s=load_s,
        ttft_ms=single.ttft_ms,
        ttft_ms_runs=single.ttft_ms_runs,
        decode_tok_s=single.decode_tok_s,
        decode_tok_s_runs=single.decode_tok_s_runs,
        decode_tok_s_ci=(low, high),
        decode_ci_coverage=coverage,
        batches=batches,
        ttft_ms_by_prompt=ttft_by_prompt_length(runtime, ids, cfg.ttft_prompt_tokens, cfg),
        latency_ms=percentiles(latencies),
        latency_ms_runs=latencies,
        prompt_tokens=len(prompt),
        new_tokens=cfg.new_tokens,
        weight_bytes=weight_bytes(folder),
        decode_read_bytes=decode_read_bytes(folder, device),
        peak_rss_mb=peak_rss_mb,
        process_rss_before_load_mb=rss_before,
        threads=target.threads,
        peak_gpu_mb=peak_gpu_mb,
        first_call_s=first_call_s,
        compile_s=getattr(runtime, "compile_s", None),
        speculation=speculation,
        served=levels,
        served_peak_rss_mb=served_peak,
        long_context=at_length,
        served_by_length=by_length,
    )


@dataclass(frozen=True)
class TrialSpread:
    """How much one metric of one variant moved between repeated benchmark trials."""

    variant: str
    metric: str
    values: list[float]  # one per trial, in trial order
    median: float
    spread: float  # (max - min) / median

    @property
    def summary(self) -> str:
        return f"{self.median:.1f} ±{self.spread / 2:.1%}"


SPREAD_METRICS = {
    "decode tok/s bs1": lambda r: r.decode_tok_s,
    "decode tok/s top batch": lambda r: r.batches[-1].decode_tok_s,
    "TTFT ms": lambda r: r.ttft_ms,
    "p95 latency ms": lambda r: r.latency_ms["p95"],
}


def trial_spread(results: dict[str, list[BenchmarkResult]]) -> list[TrialSpread]:
    """Per variant and headline metric: the values of every trial, their median and relative spread."""
    rows = []
    for variant, trials in results.items():
        for metric, read in SPREAD_METRICS.items():
            values = [read(trial) for trial in trials]
            median = statistics.median(values)
            rows.append(TrialSpread(variant, metric, values, median, (max(values) - min(values)) / median))
    return rows


def median_trial(trials: list[BenchmarkResult]) -> BenchmarkResult:
    """The trial with the median batch-1 decode speed (the lower middle one for an even count)."""
    speeds = sorted(trials, key=lambda trial: trial.decode_tok_s)
    return speeds[(len(speeds) - 1) // 2]


def memory_read_bandwidth_gbs(target: TargetConfig, megabytes: int = 512, trials: int = 10) -> float:
    """The target's memory bandwidth: on the CPU the best of `trials` sums (with the target's threads) over a
    buffer far larger than the caches; on a GPU the best device-to-device copy (bytes read plus written per
    second, synchronized)."""
    import torch

    torch.set_num_threads(target.threads)
    device = target.device
    if device.startswith("cuda"):
        source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
        target = torch.empty_like(source)

        def copy() -> None:
            target.copy_(source)
            torch.cuda.synchronize(device)

        copy()  # the first copy pays for allocation and launch set-up
        best = min(_timed(copy) for _ in range(trials))
        return 2 * source.numel() * 4 / best / 1e9
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = min(_timed(buffer.sum) for _ in range(trials))
    return buffer.numel() * 4 / best / 1e9


def roofline_fraction(decode_tok_s: float, read_bytes: int, bandwidth_gbs: float) -> float:
    """Decode speed as a share of the memory-bound ceiling: each batch-1 token reads `read_bytes` of weights."""
    return decode_tok_s * read_bytes / (bandwidth_gbs * 1e9)


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def benchmark_in_fresh_process(
    folder: Path,
    cfg: BenchmarkConfig,
    prompt_text: str,
    target: TargetConfig,
    served: ServedPlan | None = None,
) -> BenchmarkResult:
    """Run `benchmark_variant` in a new process of its own (`fresh_process_context`) and return its result."""
    from tasks.engines.manifest import read_manifest
    from tasks.measure.processes import fresh_process_context, take_parents_environment

    context = fresh_process_context(read_manifest(folder).engine)
    arguments = (str(folder), cfg.model_dump(), prompt_text, target.model_dump(), served)
    environment = (dict(os.environ),)
    with ProcessPoolExecutor(1, context, initializer=take_parents_environment, initargs=environment) as pool:
        future = pool.submit(_benchmark_as_dict, *arguments)
        failpoint("benchmark")  # tests: SIGKILL while the benchmark process runs
        result = future.result()
    result["batches"] = [BatchSpeed(**batch) for batch in result["batches"]]
    if result["speculation"] is not None:
        result["speculation"] = [
            StyleSpeed(**{**style, "ratio_ci": tuple(style["ratio_ci"])}) for style in result["speculation"]
        ]
    if result["served"] is not None:
        result["served"] = [LevelResult(**level) for level in result["served"]]
    if result["long_context"] is not None:
        result["long_context"] = [LengthSpeed(**length) for length in result["long_context"]]
    if result["served_by_length"] is not None:
        result["served_by_length"] = [capacity_from_dict(c) for c in result["served_by_length"]]
    return BenchmarkResult(**result)


def _benchmark_as_dict(
    folder: str, cfg: dict, prompt_text: str, target: dict, served: ServedPlan | None
) -> dict:
    from tasks.quiet import quiet_libraries

    quiet_libraries()  # a spawned interpreter does not inherit the CLI's warning filters and log levels
    result = benchmark_variant(
        Path(folder), BenchmarkConfig(**cfg), prompt_text, TargetConfig(**target), served
    )
    return asdict(result)

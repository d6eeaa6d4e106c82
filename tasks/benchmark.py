"""benchmark: speed and memory of one variant on the target, each variant in a fresh process.

A fresh process per variant makes peak memory honest (no allocator reuse from the previous variant) and keeps
one variant's caches from warming the next. TTFT is the latency of generating one token from the prompt
(prefill + first decode); decode speed is (N - 1) / (time for N tokens - TTFT), medians over the repeats.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.config import BenchmarkConfig
from tasks.runtime import Runtime, load_runtime


@dataclass(frozen=True)
class BenchmarkResult:
    load_s: float
    ttft_ms: float
    ttft_ms_runs: list[float]
    decode_tok_s: float
    decode_tok_s_runs: list[float]
    prompt_tokens: int
    new_tokens: int
    peak_rss_mb: float
    process_rss_before_load_mb: float
    threads: int


def decode_rate(new_tokens: int, total_s: float, ttft_s: float) -> float:
    """Tokens per second after the first token; the first token's cost belongs to TTFT."""
    return (new_tokens - 1) / max(total_s - ttft_s, 1e-9)


def measure(runtime: Runtime, prompt: list[int], cfg: BenchmarkConfig) -> tuple[list[float], list[float]]:
    """(TTFT seconds per repeat, total seconds for `new_tokens` per repeat), after `warmup` discarded runs."""
    for _ in range(cfg.warmup):
        runtime.generate([prompt], cfg.new_tokens, stop_at_eos=False)
    ttft, total = [], []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        runtime.generate([prompt], 1, stop_at_eos=False)
        ttft.append(time.perf_counter() - start)
        start = time.perf_counter()
        runtime.generate([prompt], cfg.new_tokens, stop_at_eos=False)
        total.append(time.perf_counter() - start)
    return ttft, total


def benchmark_variant(folder: Path, cfg: BenchmarkConfig, prompt_text: str, threads: int) -> BenchmarkResult:
    """Load the variant, build a prompt of exactly `prompt_tokens` tokens, measure TTFT and decode speed."""
    rss_before = _rss_mb()
    start = time.perf_counter()
    runtime = load_runtime(folder, threads)
    load_s = time.perf_counter() - start
    ids = runtime.encode(prompt_text)
    if not ids:
        raise ValueError("benchmark prompt text tokenizes to nothing")
    prompt = (ids * (cfg.prompt_tokens // len(ids) + 1))[: cfg.prompt_tokens]
    ttft, total = measure(runtime, prompt, cfg)
    median_ttft = statistics.median(ttft)
    return BenchmarkResult(
        load_s=load_s,
        ttft_ms=median_ttft * 1000,
        ttft_ms_runs=[t * 1000 for t in ttft],
        decode_tok_s=decode_rate(cfg.new_tokens, statistics.median(total), median_ttft),
        decode_tok_s_runs=[decode_rate(cfg.new_tokens, t, f) for t, f in zip(total, ttft, strict=True)],
        prompt_tokens=len(prompt),
        new_tokens=cfg.new_tokens,
        peak_rss_mb=_peak_rss_mb(),
        process_rss_before_load_mb=rss_before,
        threads=threads,
    )


def benchmark_in_fresh_process(
    folder: Path, cfg: BenchmarkConfig, prompt_text: str, threads: int
) -> BenchmarkResult:
    """Run `benchmark_variant` in a newly spawned interpreter and return its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        result = pool.submit(_benchmark_as_dict, str(folder), cfg.model_dump(), prompt_text, threads).result()
    return BenchmarkResult(**result)


def _benchmark_as_dict(folder: str, cfg: dict, prompt_text: str, threads: int) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # a spawned interpreter does not inherit the CLI's warning filters
    return asdict(benchmark_variant(Path(folder), BenchmarkConfig(**cfg), prompt_text, threads))


def _peak_rss_mb() -> float:
    """High-water resident memory of this process image.

    VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over fork and exec, so a spawned child would
    report its parent's peak (the evaluation model) instead of its own.
    """
    return _proc_status_kib("VmHWM") / 1024


def _rss_mb() -> float:
    return _proc_status_kib("VmRSS") / 1024


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; peak memory needs Linux")

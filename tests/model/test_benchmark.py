"""The benchmark on a tiny variant: sane numbers, and memory that belongs to the benchmarked process only."""

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch

from tasks.config import BenchmarkConfig, TargetConfig
from tasks.measure.benchmark import (
    BatchSpeed,
    BenchmarkResult,
    benchmark_in_fresh_process,
    decode_rate,
    decode_read_bytes,
    measure,
    median_interval,
    median_trial,
    percentiles,
    request_set,
    roofline_fraction,
    stored_tensor_bytes,
    trial_spread,
    weight_bytes,
)
from tasks.measure.processes import fresh_process_context, take_parents_environment


def test_decode_rate_excludes_the_first_token():
    assert decode_rate(new_tokens=11, total_s=1.5, ttft_s=0.5) == pytest.approx(10.0)


def test_decode_rate_counts_every_sequence_of_a_batch():
    assert decode_rate(new_tokens=11, total_s=1.5, ttft_s=0.5, batch_size=8) == pytest.approx(80.0)


def test_median_interval_uses_order_statistics_with_exact_coverage():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)  # min–max of 3 covers the median 75 %
    low, high, coverage = median_interval([float(v) for v in range(1, 12)], confidence=0.9)
    assert (low, high) == (3.0, 9.0) and coverage == pytest.approx(1 - 2 * 67 / 2048)


def test_request_set_is_fixed_and_spans_the_prompt_lengths():
    ids = list(range(50))
    requests = request_set(ids, 40, 8, 64)
    assert requests == request_set(ids, 40, 8, 64)
    assert all(8 <= len(r) <= 64 for r in requests) and len({len(r) for r in requests}) > 10


def test_roofline_fraction_is_speed_times_bytes_over_bandwidth():
    assert roofline_fraction(decode_tok_s=100, read_bytes=135_000_000, bandwidth_gbs=27) == pytest.approx(0.5)
    assert percentiles([float(v) for v in range(101)]) == {"p50": 50.0, "p95": 95.0, "p99": 99.0}


def _environment_variable(name: str) -> str | None:
    return os.environ.get(name)


def test_a_torch_variants_process_is_forked_with_its_parents_environment_of_now_and_the_others_spawned(
    monkeypatch,
):
    assert fresh_process_context("onnx_genai").get_start_method() == "spawn"
    assert fresh_process_context("llama_cpp").get_start_method() == "spawn"
    context = fresh_process_context("torch")
    assert context.get_start_method() == "forkserver"

    def in_a_fresh_process() -> str | None:
        environment = (dict(os.environ), False)
        with ProcessPoolExecutor(
            1, context, initializer=take_parents_environment, initargs=environment
        ) as pool:
            return pool.submit(_environment_variable, "LLMOPT_TEST_MARK").result()

    monkeypatch.delenv("LLMOPT_TEST_MARK", raising=False)
    assert in_a_fresh_process() is None  # the server runs from here on, with the environment of this moment
    monkeypatch.setenv("LLMOPT_TEST_MARK", "set after the server started")
    assert in_a_fresh_process() == "set after the server started"


def test_the_torch_forkservers_library_chatter_goes_to_the_commands_log_file_not_the_console(tmp_path):
    """The forkserver imports transformers (and torchao, which prints its missing CUDA kernels) before any
    measuring process takes its parent's output settings: its first preload sends what follows to the log file the
    CLI keeps, and leaves the console alone where there is none (--debug)."""
    import subprocess
    import sys

    from tasks.measure.processes import TORCH_PRELOAD

    assert TORCH_PRELOAD[0] == "tasks.measure.forkserver_quiet"
    chatter = (
        "import logging, sys, tasks.measure.forkserver_quiet; print('chatter', file=sys.stderr); "
        "logging.getLogger('torchao').warning('Failed to load a CUDA kernel')"
    )
    log = tmp_path / "command.log"
    quiet = subprocess.run(
        [sys.executable, "-c", chatter],
        env={**os.environ, "LLMOPT_LOG_FILE": str(log)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert quiet.stderr == "" and "chatter" in log.read_text()
    assert "CUDA kernel" not in log.read_text()  # below ERROR, as the CLI sets torchao's logger
    env = {key: value for key, value in os.environ.items() if key != "LLMOPT_LOG_FILE"}
    loud = subprocess.run(
        [sys.executable, "-c", chatter], env=env, capture_output=True, text=True, check=True
    )
    assert "chatter" in loud.stderr and "CUDA kernel" in loud.stderr


def test_fresh_process_reports_its_own_peak_memory_not_the_parents(baseline_dir):
    ballast = np.ones(800 * 2**20 // 8)  # 800 MB resident in this (parent) process
    cfg = BenchmarkConfig(
        prompt_tokens=8,
        new_tokens=4,
        batch_sizes=[1, 3],
        ttft_prompt_tokens=[4, 16],
        requests=5,
        request_new_tokens=3,
        warmup=0,
        repeats=2,
    )
    result = benchmark_in_fresh_process(
        baseline_dir, cfg, "The river walks the stone.", TargetConfig(threads=1)
    )
    del ballast  # kept alive until the child has finished
    assert 50 < result.peak_rss_mb < 700
    assert result.prompt_tokens == 8 and result.new_tokens == 4
    assert len(result.decode_tok_s_runs) == len(result.ttft_ms_runs) == 2
    assert [b.batch_size for b in result.batches] == [1, 3]
    assert result.batches[0].decode_tok_s == result.decode_tok_s
    assert sorted(result.ttft_ms_by_prompt) == [4, 16] and len(result.latency_ms_runs) == 5
    assert result.latency_ms == percentiles(result.latency_ms_runs)
    assert result.weight_bytes == (baseline_dir / "model.safetensors").stat().st_size
    assert (
        result.decode_read_bytes == result.weight_bytes
    )  # tied embeddings: the output layer reads them whole


def fake_result(decode: float, ttft: float = 10.0) -> BenchmarkResult:
    batch = BatchSpeed(1, ttft, decode, 1000 / decode, [decode], [ttft])
    return BenchmarkResult(
        load_s=1.0,
        ttft_ms=ttft,
        ttft_ms_runs=[ttft],
        decode_tok_s=decode,
        decode_tok_s_runs=[decode],
        decode_tok_s_ci=(decode, decode),
        decode_ci_coverage=0.0,
        batches=[batch],
        ttft_ms_by_prompt={8: ttft},
        latency_ms={"p50": 5.0, "p95": 6.0, "p99": 7.0},
        latency_ms_runs=[5.0],
        prompt_tokens=8,
        new_tokens=4,
        weight_bytes=100,
        decode_read_bytes=100,
        peak_rss_mb=10.0,
        process_rss_before_load_mb=5.0,
        threads=1,
    )


def test_trial_spread_is_range_over_median_and_the_median_trial_is_kept():
    trials = [fake_result(90.0), fake_result(110.0), fake_result(100.0, ttft=12.0)]
    spread = {row.metric: row for row in trial_spread({"v": trials})}
    assert spread["decode tok/s bs1"].values == [90.0, 110.0, 100.0]
    assert spread["decode tok/s bs1"].spread == pytest.approx(0.2)
    assert spread["TTFT ms"].median == 10.0
    assert median_trial(trials).ttft_ms == 12.0


def test_an_untied_embedding_table_is_not_counted_as_read_per_token(tmp_path):
    from safetensors.torch import save_file

    tables = {"model.embed_tokens.weight": torch.ones(100, 10), "lm_head.weight": torch.ones(100, 10)}
    save_file(tables, tmp_path / "a.safetensors")
    assert stored_tensor_bytes(tmp_path)["lm_head.weight"] == 4000
    assert decode_read_bytes(tmp_path) == weight_bytes(tmp_path) - 4000


class _Stand:
    """A runtime stand-in that counts its calls and reports (or not) its first tokens' time."""

    def __init__(self, reports: bool) -> None:
        self.reports, self.calls, self.first_token_s = reports, [], None

    def generate(self, prompts, max_new_tokens, stop_at_eos=True):
        self.calls.append(max_new_tokens)
        self.first_token_s = 0.25 if self.reports else None
        return [[1] * max_new_tokens for _ in prompts]


def test_ttft_comes_from_the_timed_call_where_the_engine_reports_it_else_from_a_one_token_call():
    reporting, silent = _Stand(reports=True), _Stand(reports=False)
    ttft, total = measure(reporting, [[1, 2]], new_tokens=8, warmup=1, repeats=3)
    assert ttft == [0.25] * 3 and len(total) == 3
    assert reporting.calls == [4, 8, 8, 8]  # the warm-up, then the timed calls only: no second prefill
    ttft, _ = measure(silent, [[1, 2]], new_tokens=8, warmup=1, repeats=3)
    assert silent.calls == [4, 8, 1, 8, 1, 8, 1] and all(0 <= t < 0.25 for t in ttft)


@pytest.mark.parametrize("engine", ["torch", "onnxruntime-genai", "llama.cpp"])
def test_served_capacity_runs_every_request_to_its_budget_through_the_scheduler_after_peak_memory(
    tiny_engine_dir, engine
):
    """Each client count replays the whole mix through the real scheduler; every request runs to its budget
    (no early end-of-sequence: the same work for every variant), every one has a first token; the serving
    decoder's memory is reported apart from the batch-1 peak."""
    from serving.models import Limits
    from tasks.config import SloConfig
    from tasks.measure.served import LoadRequest, ServedPlan

    words = [
        "the",
        "river",
        "walks",
        "the",
        "stone",
        "and",
        "the",
        "market",
        "holds",
        "the",
        "bridge",
        "over",
        "winter",
        "letters",
    ]
    requests = tuple(LoadRequest(" ".join(words[: 3 + i]), 3 + i % 4) for i in range(6))
    plan = ServedPlan(requests, Limits(max_batch=4, max_queue=4, step_tokens=16))
    cfg = BenchmarkConfig(
        prompt_tokens=8,
        new_tokens=4,
        batch_sizes=[1],
        ttft_prompt_tokens=[4],
        requests=2,
        request_new_tokens=2,
        warmup=0,
        repeats=1,
        served_clients=[1, 4],
    )
    result = benchmark_in_fresh_process(
        tiny_engine_dir(engine), cfg, "The river walks.", TargetConfig(threads=1), served=plan
    )
    assert [level.concurrency for level in result.served] == [1, 4]
    for level in result.served:
        assert level.requests == 6 and level.errors == 0
        assert level.tok_s * level.wall_s == pytest.approx(sum(r.max_tokens for r in requests))
        assert 0 < level.ttft_p50_ms <= level.ttft_p95_ms <= level.e2e_p95_ms
        assert level.goodput_rps != level.goodput_rps  # no SLO, no goodput
    assert result.served_peak_rss_mb >= result.peak_rss_mb
    short = benchmark_in_fresh_process(
        tiny_engine_dir(engine), cfg.short(), "The river walks.", TargetConfig(threads=1), served=plan
    )
    assert short.served is None and short.served_peak_rss_mb is None

    if engine == "llama.cpp":  # goodput counts the requests within the SLO
        from tasks.engines import load_runtime
        from tasks.measure.served import served_capacity

        runtime = load_runtime(tiny_engine_dir(engine), TargetConfig(threads=1))
        generous = served_capacity(runtime, replace(plan, slo=SloConfig(ttft_p95_ms=60_000)), [4])[0]
        assert generous.goodput_rps == pytest.approx(generous.requests_s)
        impossible = served_capacity(runtime, replace(plan, slo=SloConfig(ttft_p95_ms=1e-6)), [4])[0]
        assert impossible.goodput_rps == 0.0

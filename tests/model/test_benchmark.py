"""The benchmark on a tiny variant: sane numbers, and memory that belongs to the benchmarked process only."""

import numpy as np
import pytest

from tasks.benchmark import benchmark_in_fresh_process, decode_rate
from tasks.config import BenchmarkConfig, VariantConfig
from tasks.hashing import folder_sha256
from tasks.load import BaseModel
from tasks.optimize import build_variant


@pytest.fixture(scope="module")
def variant_dir(tiny_model_dir, tmp_path_factory):
    base = BaseModel(tiny_model_dir, folder_sha256(tiny_model_dir), "tiny")
    folder = tmp_path_factory.mktemp("bench") / "baseline"
    build_variant("baseline", VariantConfig(), base, "d", folder)
    return folder


def test_decode_rate_excludes_the_first_token():
    assert decode_rate(new_tokens=11, total_s=1.5, ttft_s=0.5) == pytest.approx(10.0)


def test_fresh_process_reports_its_own_peak_memory_not_the_parents(variant_dir):
    ballast = np.ones(800 * 2**20 // 8)  # 800 MB resident in this (parent) process
    cfg = BenchmarkConfig(prompt_tokens=8, new_tokens=4, warmup=0, repeats=2)
    result = benchmark_in_fresh_process(variant_dir, cfg, "The river walks the stone.", threads=1)
    del ballast  # kept alive until the child has finished
    assert 50 < result.peak_rss_mb < 700
    assert result.prompt_tokens == 8 and result.new_tokens == 4
    assert len(result.decode_tok_s_runs) == len(result.ttft_ms_runs) == 2
    assert result.decode_tok_s > 0 and result.ttft_ms > 0

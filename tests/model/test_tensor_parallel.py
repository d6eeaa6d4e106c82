"""Tensor parallelism launched by llmopt: the torch engine split over two ranks (on the CPU through gloo, the same
code that splits it over GPUs through NCCL) scores, generates and steps what the unsplit model does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.errors import TargetError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[1, 5, 9, 13, 2, 40, 41], [7, 7, 3, 20, 21, 22, 23]]


def test_a_model_split_over_two_ranks_answers_as_the_whole_model(baseline_dir: Path):
    whole = load_runtime(baseline_dir, TargetConfig(threads=1))
    split = load_runtime(baseline_dir, TargetConfig(threads=1, tensor_parallel=2))
    try:
        weight = split.model.model.layers[0].mlp.gate_proj.weight
        assert type(weight).__name__ == "DTensor"  # really sharded, not a copy per rank
        assert split.generate(PROMPTS, 6, stop_at_eos=False) == whole.generate(PROMPTS, 6, stop_at_eos=False)
        for (nll_split, n_split), (nll, n) in zip(split.score(PROMPTS), whole.score(PROMPTS), strict=True):
            # float32 on both sides; the ranks' partial sums are added in another order (rounding, ~1e-6)
            assert n_split == n and nll_split == pytest.approx(nll, rel=1e-4)
        assert np.allclose(split.logits(PROMPTS).numpy(), whole.logits(PROMPTS).numpy(), atol=1e-4)
        decoder, reference = split.batch_decoder(), whole.batch_decoder()
        (a, logits_a), (b, logits_b) = decoder.add(PROMPTS[0]), reference.add(PROMPTS[0])
        assert np.allclose(logits_a, logits_b, atol=1e-4)
        stepped, expected = decoder.step({a: 50}), reference.step({b: 50})
        assert np.allclose(stepped[a], expected[b], atol=1e-4) and decoder.active == 1
        decoder.remove(a)
        assert decoder.active == 0
    finally:
        split.close()
    assert all(not worker.is_alive() for worker in split._workers)


def test_tensor_parallelism_is_the_torch_engines_and_splits_float_weights_only(tmp_path: Path, tiny_base):
    from tasks.params import VariantConfig
    from tasks.techniques.build import build_variant

    recipe = {"steps": [{"quantize": {"method": "torchao_int8_weight_only"}}]}
    build_variant("int8", VariantConfig.model_validate(recipe), tiny_base, "d", tmp_path / "int8")
    with pytest.raises(TargetError, match="splits float weights, not hf-quantized ones"):
        load_runtime(tmp_path / "int8", TargetConfig(threads=1, tensor_parallel=2))


def test_the_benchmark_measures_a_split_model_in_its_fresh_process(baseline_dir: Path):
    from tasks.config import BenchmarkConfig
    from tasks.measure.benchmark import benchmark_in_fresh_process

    cfg = BenchmarkConfig(
        prompt_tokens=8, new_tokens=4, batch_sizes=[1], ttft_prompt_tokens=[8], requests=1, repeats=1
    )
    result = benchmark_in_fresh_process(
        baseline_dir, cfg, "river stone garden " * 4, TargetConfig(threads=1, tensor_parallel=2)
    )
    assert result.decode_tok_s > 0 and result.latency_ms["p50"] > 0

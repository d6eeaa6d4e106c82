"""A cuda target: the device comes from params.yaml into the engine in one place (`load_runtime`), engines refuse a
device they do not run on, and on a GPU the torch engine decodes what it decodes on the CPU (tests marked `cuda`
run wherever torch sees a GPU; elsewhere they are the one skip the suite allows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.errors import TargetError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 3]]


def test_an_engine_refuses_a_device_it_does_not_run_on_naming_those_it_does(baseline_dir: Path):
    with pytest.raises(TargetError, match=r"the torch engine runs on cpu, cuda, not xpu$"):
        load_runtime(baseline_dir, TargetConfig.model_construct(threads=1, device="xpu", tensor_parallel=1))


@pytest.mark.cuda
def test_the_torch_engine_on_cuda_decodes_and_scores_as_on_the_cpu(baseline_dir: Path):
    cpu, gpu = (
        load_runtime(baseline_dir, TargetConfig(threads=1)),
        load_runtime(baseline_dir, threads=1, device="cuda"),
    )
    assert next(gpu.model.parameters()).device.type == "cuda"
    assert gpu.generate(PROMPTS, 8) == cpu.generate(PROMPTS, 8)  # fp32: TF32 is off by default in torch
    for (nll_gpu, n_gpu), (nll_cpu, n_cpu) in zip(gpu.score(PROMPTS), cpu.score(PROMPTS), strict=True):
        assert n_gpu == n_cpu and nll_gpu == pytest.approx(nll_cpu, rel=1e-4)
    decoder = gpu.batch_decoder()
    sequence, logits = decoder.add(PROMPTS[0])
    assert logits.shape[-1] == gpu.model.config.vocab_size  # host numpy logits for the server's sampler


@pytest.mark.cuda
def test_a_cuda_target_measures_the_gpu_it_runs_on():
    from tasks.measure.benchmark import memory_read_bandwidth_gbs
    from tasks.measure.fingerprint import machine_fingerprint

    fingerprint = machine_fingerprint(TargetConfig(threads=1, device="cuda"))
    assert fingerprint["gpu"]["name"] and fingerprint["gpu"]["capability"]
    assert fingerprint["hash"] != machine_fingerprint(TargetConfig(threads=1))["hash"]
    assert (
        memory_read_bandwidth_gbs(TargetConfig(threads=1, device="cuda"), megabytes=64, trials=3) > 50
    )  # any GPU's HBM/GDDR


def test_the_gpus_padded_batch_decoder_steps_sequences_of_different_lengths_as_each_alone(baseline_dir: Path):
    """The padded decoder a cuda target serves with, run on the CPU: one forward call a step for every sequence,
    logits equal to a sequence stepped alone within fp32 rounding, and sequences may join and leave between steps."""
    import numpy as np

    from tasks.engines.pytorch.runtime import PaddedBatchDecoder

    runtime = load_runtime(baseline_dir, TargetConfig(threads=1))
    alone, padded = (
        runtime.batch_decoder(),
        PaddedBatchDecoder(runtime.model, runtime._no_grad, runtime.device),
    )
    assert type(alone) is not PaddedBatchDecoder  # the CPU keeps the exact one-call-a-sequence decoder
    prompts = [[1, 5, 9, 13, 2, 40, 41], [7, 7, 3], [11, 12, 13, 14, 15]]
    joined = {}
    for prompt in prompts[:2]:
        (a, logits_a), (b, logits_b) = alone.add(prompt), padded.add(prompt)
        joined[b] = a
        assert np.allclose(logits_a, logits_b, atol=1e-5)
    steps_before = padded.steps
    for step in range(6):
        if step == 3:  # a newcomer joins mid-flight, and the first sequence leaves
            (a, _), (b, _) = alone.add(prompts[2]), padded.add(prompts[2])
            joined[b] = a
            first = next(iter(joined))
            padded.remove(first), alone.remove(joined.pop(first))
        tokens = {b: (step * 17 + b) % 300 for b in joined}
        expected = alone.step({joined[b]: token for b, token in tokens.items()})
        got = padded.step(tokens)
        for b, a in joined.items():
            assert np.allclose(got[b], expected[a], atol=1e-4), (step, b)
    assert padded.steps - steps_before == 7  # 6 steps, one call each, plus the newcomer's prompt

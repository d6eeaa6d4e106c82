"""Each weight technique on the briefly trained tiny model: it stores what it claims (the engine's stored bits or
types; in PyTorch every decoder matrix's effective weights on a grid of 2^bits levels, or on NF4/FP4's codebook)
and changes the model by an amount inside a band that a no-op quantizer and a weight-scrambling one both fall
outside of. The band is on the KL divergence of the variant's next-token distribution from fp32's, read through the
engine's own decode path: on this model a quantizer moves held-out NLL by ±0.003 nat in either direction, so NLL
cannot tell a no-op from a good 8-bit quantizer, while KL is zero only for an unchanged model.

The planted broken quantizers (`noop`: stores the float weights and claims the method; `scramble`: quantizes
weights it has put in the wrong places, as a packing bug would; `four_bit`: rounds to 4 bits, then stores 8) are
negative controls: the checks must reject each
(`test_the_checks_reject_a_planted_*`, `test_the_eight_bit_checks_reject_a_planted_*`). `pytest --planted-quantizer=noop|scramble|four_bit tests/model/test_techniques.py`
builds every technique with the broken one and shows the technique tests failing."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.engines.manifest import read_manifest
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.techniques import (
    CALIBRATION,
    CLAIMS,
    HELD_OUT,
    assess,
    claim_failures,
    planted_quantizer,
)


def test_the_trained_model_is_far_from_uniform(reference):
    runtime = reference.runtime
    ((nll, tokens),) = runtime.score([runtime.encode(HELD_OUT)[:256]])
    assert nll / tokens < 0.5 * np.log(runtime.model.config.vocab_size)  # uniform: ln V


@pytest.mark.parametrize("name", list(CLAIMS))
def test_technique_stores_what_it_claims_and_changes_the_model_within_its_band(
    trained_variants, reference, name
):
    problems, measured = assess(trained_variants[name], CLAIMS[name], reference)
    failures = claim_failures(CLAIMS[name], problems, measured)
    assert not failures, f"{name}: {failures}"
    print(
        f"{name}: KL {measured.kl:.3g}, NLL {measured.nll_increase:+.4f}, agreement {measured.agreement:.0%}"
    )


@pytest.mark.parametrize(
    ("four", "eight"),
    [
        ("onnx_int4", "onnx_int8"),
        ("quanto_w4a16", "quanto_w8a16"),
        ("bnb_nf4", "bnb_int8"),
        ("llama_q4_0", "llama_q8_0"),
    ],
)
def test_four_bit_weights_are_smaller_than_eight_bit_and_eight_bit_than_fp32(trained_variants, four, eight):
    sizes = {n: read_manifest(trained_variants[n]).size_bytes for n in (four, eight, "baseline")}
    assert sizes[four] < sizes[eight] < 0.75 * sizes["baseline"]


def test_gptq_onto_torchaos_grid_is_closer_to_fp32_than_torchaos_round_to_nearest(
    trained_variants, reference
):
    kl = {
        name: assess(trained_variants[name], CLAIMS[name], reference)[1].kl
        for name in ("torchao_int4_tinygemm", "torchao_int4_gptq")
    }
    assert kl["torchao_int4_gptq"] < 0.8 * kl["torchao_int4_tinygemm"], kl


CONTROLS = [
    "torch_dynamic_int8",
    "torchao_int4_weight_only",
    "torchao_int4_gptq",  # quantized when loaded (torchao packs the stored grid)
    "quanto_w8a16",
    "bnb_nf4",
    "onnx_int4",
    "llama_q4_0",
]


@pytest.mark.parametrize("kind", ["noop", "scramble"])
@pytest.mark.parametrize("name", CONTROLS)
def test_the_checks_reject_a_planted_broken_quantizer(
    trained_base, reference, tmp_path, monkeypatch, kind, name
):
    """Negative controls: the same checks the technique tests run must fail for a no-op and a scrambling quantizer
    in every mechanism (torch backends, ONNX export, llama.cpp)."""
    claim = CLAIMS[name]
    with planted_quantizer(kind, monkeypatch):
        build_variant(
            name, VariantConfig.model_validate(claim.recipe), trained_base, "d", tmp_path / name, CALIBRATION
        )
    problems, measured = assess(tmp_path / name, claim, reference)
    failures = claim_failures(claim, problems, measured)
    print(f"{kind} {name}: {failures}")
    low, high = claim.kl_band
    if kind == "noop":  # each check alone catches it: float weights stored, and no change at all
        assert problems and measured.kl < low, failures
    else:  # stored like the real one, but the model is destroyed
        assert measured.kl > high and measured.nll_increase > 0.05, failures


# One 8-bit method per way its claim is checked: torch's effective weights (level count), quanto W8A8's stored weights
# (its outputs are quantized too), and the ONNX and GGUF exports, whose stored bits say 8 either way (the KL band)
FOUR_BIT_CONTROLS = ["torch_dynamic_int8", "quanto_w8a8", "onnx_int8", "llama_q8_0"]


@pytest.mark.parametrize("name", FOUR_BIT_CONTROLS)
def test_the_eight_bit_checks_reject_a_planted_method_that_rounds_to_four_bits(
    trained_base, reference, tmp_path, monkeypatch, name
):
    """Negative control: an "8-bit" method whose weights were rounded to 4 bits first (one scale per row) stores
    8-bit numbers all the same; its rows hold at most 16 distinct values, and its KL from fp32 lies above the
    weight-only 8-bit band."""
    claim = CLAIMS[name]
    with planted_quantizer("four_bit", monkeypatch):
        build_variant(
            name, VariantConfig.model_validate(claim.recipe), trained_base, "d", tmp_path / name, CALIBRATION
        )
    problems, measured = assess(tmp_path / name, claim, reference)
    failures = claim_failures(claim, problems, measured)
    print(f"four_bit {name}: {failures}")
    assert failures
    if claim.stored == "grid":
        assert problems and all("distinct values (a 4-bit grid" in problem for problem in problems), problems
    else:
        assert measured.kl > claim.kl_band[1], failures

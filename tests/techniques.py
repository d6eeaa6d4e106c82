"""What each weight technique claims and the checks that hold it to the claim (tests/model/test_techniques.py):
the stored bits or types, effective weights on the claimed grid, and a KL band from fp32 that a no-op quantizer and
a weight-scrambling one both fall outside of; plus those two planted broken quantizers, the negative controls."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config import TargetConfig
from tasks.engines import Runtime, load_runtime
from tests.factories import synthetic_sentences


@dataclass(frozen=True)
class Claim:
    """What a technique says it does: its recipe, how its stored weights must look, and its KL band (nats/token)."""

    recipe: dict
    stored: str  # "grid": effective weights on 2^bits levels per group; "nf4"/"fp4": codebook; "onnx"; "gguf"; "bf16"
    bits: int
    kl_band: tuple[float, float]
    # input columns checked together: a divisor of every method's own group (a subset of a grid stays on it)
    group: int = 16
    types: tuple[str, ...] = ()  # gguf: the tensor types the decoder matrices may have


def _quantize(method: str) -> dict:
    return {"steps": [{"quantize": {"method": method}}]}


# Bands, from the KLs measured on the trained model (weight-only 8-bit 8.2e-6…3.0e-5; 8-bit with quantized activations
# 3.1e-5…6.5e-4; 4-bit 2.2e-4…3.5e-3; bf16 3.2e-5): the engines' own float noise (ONNX fp32 2e-13, llama.cpp F32
# 1e-8: what the no-op plant leaves) lies below every lower bound, a scrambled model (KL 5.8) far above every upper
# bound. Weight-only 8-bit stops at 1.5e-4: 5× above its largest KL, below every 4-bit one, and 12× below what
# weights rounded to 4 bits per row and then stored at 8 bits give (the `four_bit` plant: ONNX int8 1.8e-3, llama.cpp
# Q8_0 1.9e-3) — for the ONNX and GGUF exports, whose stored bits say 8 either way, the KL is what tells. With
# quantized activations the noise of the activations reaches the 4-bit range, so those keep the wide band and the
# level count (`levels_used`: a row rounded to 4 bits holds at most 16 values) tells them from 4 bits instead.
EIGHT, EIGHT_W8A8, FOUR = (2e-7, 1.5e-4), (2e-7, 0.02), (1.5e-5, 0.1)
CLAIMS = {
    "bf16": Claim({"runtime": {"dtype": "bfloat16"}}, "bf16", 16, (1e-6, 1e-3)),
    "torch_dynamic_int8": Claim(_quantize("torch_dynamic_int8"), "grid", 8, EIGHT_W8A8),
    "torchao_int8_weight_only": Claim(_quantize("torchao_int8_weight_only"), "grid", 8, EIGHT),
    "torchao_int8_dynamic": Claim(_quantize("torchao_int8_dynamic"), "grid", 8, EIGHT_W8A8),
    "torchao_int4_weight_only": Claim(_quantize("torchao_int4_weight_only"), "grid", 4, FOUR),
    "torchao_int4_tinygemm": Claim(_quantize("torchao_int4_tinygemm"), "grid", 4, FOUR),
    "torchao_int4_gptq": Claim(_quantize("torchao_int4_gptq"), "grid", 4, FOUR),
    "quanto_w8a16": Claim(_quantize("quanto_w8a16"), "grid", 8, EIGHT),
    "quanto_w4a16": Claim(_quantize("quanto_w4a16"), "grid", 4, FOUR),
    "quanto_w8a8": Claim(_quantize("quanto_w8a8"), "grid", 8, EIGHT_W8A8),
    "bnb_int8": Claim(_quantize("bnb_int8"), "grid", 8, EIGHT),
    "bnb_nf4": Claim(_quantize("bnb_nf4"), "nf4", 4, FOUR),
    "bnb_fp4": Claim(_quantize("bnb_fp4"), "fp4", 4, FOUR),
    "onnx_int8": Claim({"steps": [{"onnx_genai": {"precision": "int8"}}]}, "onnx", 8, EIGHT),
    "onnx_int4": Claim({"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32}}]}, "onnx", 4, FOUR),
    "onnx_int4_weighted": Claim(
        {
            "steps": [
                {
                    "onnx_genai": {
                        "precision": "int4",
                        "rounding": "gptq",
                        "scales": "weighted",
                        "lm_head": "int8",
                    }
                }
            ]
        },
        "onnx",
        4,
        FOUR,
    ),
    "onnx_int4_asym": Claim(
        {"steps": [{"onnx_genai": {"precision": "int4", "symmetric": False, "block_size": 16}}]},
        "onnx",
        4,
        FOUR,
    ),
    "llama_q8_0": Claim({"steps": [{"llama_cpp": {"type": "Q8_0"}}]}, "gguf", 8, EIGHT, types=("Q8_0",)),
    "llama_q4_0": Claim({"steps": [{"llama_cpp": {"type": "Q4_0"}}]}, "gguf", 4, FOUR, types=("Q4_0",)),
    # 64 columns are too few for K-quants' 256-weight super-blocks: llama.cpp falls back per tensor (Q4_K → Q4_0…Q5_1,
    # and the Q6_K that Q4_K_M gives some layers' attn_v and ffn_down → Q8_0)
    "llama_q4_k_m": Claim(
        {"steps": [{"llama_cpp": {"type": "Q4_K_M"}}]},
        "gguf",
        4,
        FOUR,
        types=("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
    ),
}
# Built beside the claimed techniques: the references of the same-graph checks (test_variants.py).
FP32_RECIPES = {"baseline": {}, "onnx_fp32": {"steps": [{"onnx_genai": {"precision": "fp32"}}]}}
CALIBRATION = [" ".join(synthetic_sentences(20, seed=seed)) for seed in range(3)]
HELD_OUT = " ".join(synthetic_sentences(40, seed=4242))  # text the model was not trained on
WINDOW, WINDOWS, GENERATED = 32, 3, 12  # 93 positions of KL: bands hold with a 20× margin either side
LAYERS = 2  # the tiny model's: 7 matrices a layer (the ONNX builder fuses q, k and v: 5)
DECODER_MATRIX = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj$")
FOUR_BIT_LEVELS = 16  # the most distinct values a row rounded to 4 bits with one scale can hold


# --- the planted broken quantizers (negative controls) ---------------------------------------------------------


def _scrambled(model):
    """The model with every decoder matrix's entries permuted (seeded): the values a quantizer stores, in the wrong
    places."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if DECODER_MATRIX.search(name):
                flat = module.weight.data.view(-1)
                flat.copy_(flat[torch.randperm(flat.numel(), generator=generator)])
    return model


def _four_bit(model):
    """The model with every decoder matrix rounded to 4 bits (symmetric, one scale per output row: 15 levels):
    what an "8-bit" method that really rounds to 4 bits leaves, whatever it then stores."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if DECODER_MATRIX.search(name):
                weight = module.weight.data
                scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 7
                weight.copy_(torch.round(weight / scale).clamp(-7, 7) * scale)
    return model


def _rewritten_folder(source: Path, scratch: Path, rewrite) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rewrite(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)).save_pretrained(scratch)
    AutoTokenizer.from_pretrained(source).save_pretrained(scratch)
    return scratch


@contextlib.contextmanager
def planted_quantizer(kind: str | None, monkeypatch: pytest.MonkeyPatch):
    """Replace every quantizer llmopt has (torch backends, the ONNX export, llama.cpp's quantizer) with a broken
    one for the duration: `noop` keeps float weights under the method's name, `scramble` quantizes scrambled ones,
    `four_bit` rounds the weights to 4 bits first (an 8-bit method that is 4-bit inside)."""
    if kind is None:
        yield
        return
    import tasks.engines.llama_cpp.gguf as gguf
    import tasks.engines.onnx.export as onnx_export
    import tasks.techniques.quantize.step as quantize
    from tasks.techniques.quantize.methods import Quantized
    from tasks.weights.safetensors import HF_SAFETENSORS

    real_quantize, real_export = quantize.quantize_model, onnx_export.build_onnx_genai
    real_convert = gguf.convert_to_gguf
    scratch = Path(tempfile.mkdtemp(prefix="planted-"))
    if kind == "noop":
        monkeypatch.setattr(
            quantize,
            "quantize_model",
            lambda model, step, calibration, *rest: Quantized(model, HF_SAFETENSORS),
        )
        monkeypatch.setattr(
            onnx_export,
            "build_onnx_genai",
            lambda source, dest, export, *a: real_export(
                source, dest, export.model_copy(update={"precision": "fp32"}), *a
            ),
        )
        monkeypatch.setattr(gguf, "quantize_gguf", lambda f32, dest, *a, **k: shutil.copyfile(f32, dest))
    else:
        rewrite = _scrambled if kind == "scramble" else _four_bit
        monkeypatch.setattr(
            quantize,
            "quantize_model",
            lambda m, step, cal, *rest: real_quantize(rewrite(m), step, cal, *rest),
        )

        def rewritten_export(source, dest, export, *args):
            return real_export(_rewritten_folder(source, scratch / "onnx", rewrite), dest, export, *args)

        monkeypatch.setattr(onnx_export, "build_onnx_genai", rewritten_export)
        monkeypatch.setattr(
            gguf,
            "convert_to_gguf",
            lambda source, out: real_convert(_rewritten_folder(source, scratch / "gguf", rewrite), out),
        )
    try:
        yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- the checks ------------------------------------------------------------------------------------------------


def position_logits(runtime: Runtime, window: list[int]) -> np.ndarray:
    """Next-token logits at every position of `window`, teacher-forced through the engine's batch decoder (the path
    serving uses), as float64."""
    decoder = runtime.batch_decoder()
    sequence, logits = decoder.add(window[:1])
    rows = [logits]
    for token in window[1:]:
        rows.append(decoder.step({sequence: token})[sequence])
    decoder.remove(sequence)
    return np.stack([np.asarray(row, dtype=np.float64) for row in rows])


def kl_from_reference(reference: list[np.ndarray], variant: list[np.ndarray]) -> float:
    """Mean KL(reference ‖ variant) per position, in nats: zero only when the two predict alike."""
    total, positions = 0.0, 0
    for ref, var in zip(reference, variant, strict=True):
        log_ref = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
        log_var = var - np.logaddexp.reduce(var, axis=1, keepdims=True)
        total += float((np.exp(log_ref) * (log_ref - log_var)).sum())
        positions += len(ref)
    return total / positions


def off_uniform_grid(
    groups: np.ndarray, levels: int, tolerance: float = 0.02, read_precision: float = 0.0
) -> np.ndarray:
    """Per row of `groups`, True unless its values are offset + k·step for integers k spanning fewer than `levels`
    steps (how any affine quantizer dequantizes, symmetric or not). Random float weights never are: each interior
    value of a group would have to land within `tolerance` of a grid line. `read_precision`: the relative rounding
    of the values as read (bfloat16 outputs: 2^-8), added to the tolerance in grid steps, at most 0.1."""
    low = groups.min(axis=1, keepdims=True)
    span = groups.max(axis=1, keepdims=True) - low
    flat = span[:, 0] <= 1e-9 * np.maximum(1.0, np.abs(groups).max(axis=1))
    unit = (groups - low) / np.where(flat[:, None], 1.0, span)
    scaled = unit[:, :, None] * np.arange(1, levels)[None, None, :]  # every candidate count of steps at once
    reading = (
        (levels - 1)
        * read_precision
        * np.abs(groups).max(axis=1, keepdims=True)
        / np.where(flat, 1.0, span[:, 0])[:, None]
    )
    allowed = np.minimum(tolerance + reading, 0.1)[:, :, None]
    fits = (np.abs(scaled - np.round(scaled)) < allowed).all(axis=1).any(axis=1)
    return ~(fits | flat)


def levels_used(rows: np.ndarray, read_precision: float = 0.0) -> np.ndarray:
    """Per row, how many distinct values it holds: values closer than the reading's rounding (`read_precision` of
    the row's largest magnitude, at least 1e-6 of its span) count as one. A row rounded to b bits holds at most 2^b;
    one of 64 trained weights rounded to 8 bits holds ~40–60 (they spread over most of the 255 levels)."""
    ordered = np.sort(rows, axis=1)
    span = ordered[:, -1:] - ordered[:, :1]
    close = np.maximum(1e-6 * span, read_precision * np.abs(rows).max(axis=1, keepdims=True))
    return 1 + (np.diff(ordered, axis=1) > close).sum(axis=1)


def off_codebook(
    groups: np.ndarray, codebook: np.ndarray, tolerance: float = 2e-3, read_precision: float = 0.0
) -> np.ndarray:
    """Per row of `groups`, True unless its values divided by their largest magnitude are all `codebook` entries
    (scaled to ±1): how NF4/FP4 dequantize, one absmax per block. `read_precision`: the relative rounding of the
    values as read, added to the tolerance (bitsandbytes' fused CPU kernel on AVX512-BF16 machines computes in
    bfloat16: 2^-8, the value and its block's largest each rounded). The entries lie at least 0.08 apart, so even
    then a block of random floats cannot pass."""
    scale = np.abs(groups).max(axis=1, keepdims=True)
    normalised = groups / np.where(scale == 0, 1.0, scale)
    distance = np.abs(normalised[:, :, None] - codebook[None, None, :]).min(axis=2)
    return (distance >= tolerance + read_precision).any(axis=1)


def effective_weights(model) -> dict[str, np.ndarray]:
    """Each decoder matrix as it acts at run time (out × in), read by passing the identity through the module: what
    a quantized module really multiplies by, whatever its storage (activation quantization of a one-hot row is
    exact, so W8A8 methods show their weights too)."""
    found = {}
    dtype = model.get_input_embeddings().weight.dtype  # the activations' (bfloat16 for torchao's tinygemm)
    with torch.no_grad():
        for name, module in model.named_modules():
            if DECODER_MATRIX.search(name) and getattr(module, "activation_qtype", None) is not None:
                # quanto's W8A8 quantizes the module's outputs too, on a scale calibrated for real activations:
                # the probe would read that coarse output grid, so its stored weights are read instead
                found[name] = module.qweight.dequantize().double().numpy()
            elif DECODER_MATRIX.search(name):
                columns = module.in_features
                probe = torch.eye(columns, dtype=dtype)[None]
                found[name] = module(probe)[0].double().numpy().T
    return found


def codebook(kind: str) -> np.ndarray:
    import bitsandbytes.functional as bnb

    values = bnb.get_4bit_type(kind, device="cpu").double().numpy()
    return values / np.abs(values).max()


def stored_problems(folder: Path, claim: Claim, runtime: Runtime) -> list[str]:
    """Where the stored variant is not what `claim` says (empty when it is)."""
    if claim.stored == "onnx":
        from tasks.engines.onnx.export import weight_bits

        bits = weight_bits(folder)
        matrices = {n: b for n, b in bits.items() if "layers." in n}
        problems = [f"{n}: {b} bits" for n, b in matrices.items() if b != claim.bits]
        return problems + (
            [] if len(matrices) == 5 * LAYERS else [f"{len(matrices)} of {5 * LAYERS} matrices quantized"]
        )
    if claim.stored == "gguf":
        from tasks.engines.llama_cpp.gguf import tensor_types
        from tasks.engines.llama_cpp.runtime import MODEL_FILE

        types = {
            n: t
            for n, t in tensor_types(folder / MODEL_FILE).items()
            if n.startswith("blk.") and "norm" not in n
        }
        problems = [f"{n}: {t}" for n, t in types.items() if t not in claim.types]
        return problems + (
            [] if len(types) == 7 * LAYERS else [f"{len(types)} of {7 * LAYERS} matrices in the GGUF"]
        )
    if claim.stored == "bf16":
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "pt") as weights:
            dtypes = {weights.get_slice(k).get_dtype() for k in weights.keys()}  # noqa: SIM118
        return [] if dtypes == {"BF16"} else [f"stored dtypes {sorted(dtypes)}"]
    problems = []
    book = codebook(claim.stored) if claim.stored in ("nf4", "fp4") else None
    bfloat16 = runtime.model.get_input_embeddings().weight.dtype == torch.bfloat16  # outputs read in bfloat16
    # bitsandbytes repacks 4-bit weights at the first inference call on a CPU with AVX512-BF16 and multiplies in
    # bfloat16 from then on (its own flag says which): its outputs are read at bfloat16's precision
    fused_bfloat16 = any(getattr(m, "support_avx512bf16_for_cpu", False) for m in runtime.model.modules())
    for name, weight in effective_weights(runtime.model).items():
        if book is not None:  # bitsandbytes: blocks of 64 along the flattened (row-major) weight
            groups = weight.reshape(-1, 64)
            bad = int(off_codebook(groups, book, read_precision=2**-8 if fused_bfloat16 else 0.0).sum())
        else:
            groups = weight.reshape(-1, claim.group)
            bad = int(
                off_uniform_grid(groups, 2**claim.bits, read_precision=2**-8 if bfloat16 else 0.0).sum()
            )
        if bad:
            problems.append(
                f"{name}: {bad} of {len(groups)} groups off the {claim.stored}/{claim.bits}-bit grid"
            )
        if (
            claim.bits == 8 and book is None
        ):  # a 16-column group fits 256 levels and 16 alike: count them per row
            counts = levels_used(weight, read_precision=2**-8 if bfloat16 else 0.0)
            if few := int((counts <= FOUR_BIT_LEVELS).sum()):
                problems.append(
                    f"{name}: {few} of {len(counts)} rows hold at most {FOUR_BIT_LEVELS} distinct values (a 4-bit "
                    f"grid; fewest {counts.min()})"
                )
    return problems


@dataclass(frozen=True)
class Reference:
    """fp32's answers on the held-out windows, computed once: logits at every position, NLL, greedy tokens."""

    runtime: Runtime
    windows: list[list[int]]
    logits: list[np.ndarray]
    nll: float
    generated: list[list[int]]

    @classmethod
    def of(cls, runtime: Runtime) -> Reference:
        ids = runtime.encode(HELD_OUT)
        windows = [ids[i : i + WINDOW] for i in range(0, WINDOWS * WINDOW, WINDOW)]
        return cls(
            runtime,
            windows,
            [position_logits(runtime, w) for w in windows],
            sum(n for n, _ in runtime.score(windows)),
            runtime.generate([w[:8] for w in windows], GENERATED, stop_at_eos=False),
        )


@dataclass(frozen=True)
class Measured:
    kl: float
    nll_increase: float  # per held-out token, against fp32
    agreement: float  # greedy tokens equal to fp32's


def measure(runtime: Runtime, reference: Reference) -> Measured:
    kl = kl_from_reference(reference.logits, [position_logits(runtime, w) for w in reference.windows])
    tokens = sum(len(w) - 1 for w in reference.windows)
    increase = (sum(n for n, _ in runtime.score(reference.windows)) - reference.nll) / tokens
    got = runtime.generate([w[:8] for w in reference.windows], GENERATED, stop_at_eos=False)
    pairs = [(a, b) for g, e in zip(got, reference.generated, strict=True) for a, b in zip(g, e, strict=True)]
    return Measured(kl, increase, sum(a == b for a, b in pairs) / len(pairs))


def claim_failures(claim: Claim, problems: list[str], measured: Measured) -> list[str]:
    """How a variant falls short of `claim` (empty when it keeps it): stored as claimed, changed within the KL band,
    held-out loss at most 0.05 nat/token worse, greedy output mostly fp32's."""
    low, high = claim.kl_band
    failures = [f"does not store what it claims: {problems[:4]}"] if problems else []
    if not low < measured.kl < high:
        failures.append(f"KL from fp32 {measured.kl:.3g} outside ({low:g}, {high:g})")
    if measured.nll_increase >= 0.05:
        failures.append(f"held-out NLL +{measured.nll_increase:.3f} nat/token")
    if measured.agreement < 0.5:
        failures.append(f"greedy agreement with fp32 {measured.agreement:.0%}")
    return failures


def assess(folder: Path, claim: Claim, reference: Reference) -> tuple[list[str], Measured]:
    """(what the stored weights get wrong, the measurements) of the variant in `folder`."""
    runtime = load_runtime(folder, TargetConfig(threads=1))
    return stored_problems(folder, claim, runtime), measure(runtime, reference)

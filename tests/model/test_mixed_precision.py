"""Accuracy-aware mixed precision: a planted sensitive matrix stays int8 in the exported graph, every other matrix
goes to int4, and the search sees the calibration split only."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cluster import Stored, Workspace
from flows.stages import Inputs, optimize_task
from tasks.config import VariantConfig
from tasks.inputs.data import write_splits
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.techniques.mixed_precision import export_matrices, fake_quantize
from tasks.techniques.onnx_export import weight_bits
from tests.factories import synthetic_sentences

PLANTED = "/model/layers.1/mlp/down_proj/MatMul"
RECIPE = {
    "steps": [
        {
            "onnx_genai": {
                "precision": "int4",
                "block_size": 32,
                "mixed_precision": {"target_ppl_increase": 0.01, "windows": 8, "window_tokens": 128},
            }
        }
    ]
}


@pytest.fixture(scope="module")
def planted_base(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, one_torch_thread
) -> PreparedBase:
    """The tiny model with outliers planted in one matrix (every 32nd input column ×100: int4's one scale per
    block of 32 then rounds the rest of each block to zero, int8's does not), trained until its loss is low, so
    that accuracy depends on the weights (a random model's loss barely moves under any rounding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[:, ::32] *= 100
    ids = tokenizer(" ".join(synthetic_sentences(600, seed=5)))["input_ids"]
    batches = torch.tensor([ids[i : i + 64] for i in range(0, 64 * 64, 64)])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):
        batch = batches[(step * 8) % 64 :][:8]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = tmp_path_factory.mktemp("planted")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return PreparedBase(folder, folder_sha256(folder), "planted")


def _build_reading_only_calibration(recipe, planted_base, tmp_path, monkeypatch):
    """Build `recipe` on the planted model through the optimize stage; the search must see calibration text only
    (the evaluation split holds words the calibration split never has)."""
    import tasks.techniques.mixed_precision as mixed_precision

    calibration = [" ".join(synthetic_sentences(40, seed=s)) for s in range(6)]
    evaluation = ["zebra quartz " * 30]
    data = write_splits({"calibration": calibration, "evaluation": evaluation}, tmp_path / "data")
    seen = []
    real_search = mixed_precision.search

    def search(model, windows, *args, **kwargs):
        seen.extend(windows)
        return real_search(model, windows, *args, **kwargs)

    monkeypatch.setattr(mixed_precision, "search", search)
    inputs = Inputs(planted_base, Stored(planted_base.path), data, Stored(tmp_path / "data"))
    built = optimize_task.fn(
        "mixed", VariantConfig.model_validate(recipe), inputs, Workspace(tmp_path / "work")
    )

    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(planted_base.path).decode(sum(seen, []))
    assert seen and "zebra" not in text and "quartz" not in text  # the evaluation split never reached it
    return built, tmp_path / "work" / "variants" / "mixed"


def test_the_planted_matrix_stays_int8_and_the_rest_goes_int4_using_calibration_text_only(
    planted_base, tmp_path, monkeypatch
):
    built, folder = _build_reading_only_calibration(RECIPE, planted_base, tmp_path, monkeypatch)
    plan = built.manifest.mixed_precision
    kept = [m["node"] for m in plan["matrices"] if m["bits"] == 8]
    assert kept == [PLANTED], plan
    assert plan["measured_ppl_increase"] <= 0.01 < plan["int4_ppl_increase"]
    exported = weight_bits(folder)
    assert exported.pop(PLANTED) == 8
    embedding = "/model/embed_tokens/GatherBlockQuantized"  # still the int4 table shared with the lm_head
    assert exported == {embedding: 4} | {m["node"]: 4 for m in plan["matrices"] if m["node"] != PLANTED}
    assert "1 of 11 matrices kept at int8" in " ".join(built.manifest.notes)


def test_llama_cpp_keeps_the_planted_layer_at_q8_0_and_the_rest_at_q4_0_using_calibration_text_only(
    planted_base, tmp_path, monkeypatch
):
    """In llama.cpp the search measures each layer at Q8_0 and each plan in llama.cpp itself: the layer holding
    the planted matrix is kept, the other goes to Q4_0, and the GGUF stores exactly that."""
    from tasks.techniques.gguf import tensor_types

    settings = RECIPE["steps"][0]["onnx_genai"]["mixed_precision"] | {
        "size_budget": 0.8
    }  # one of 2 layers fits
    recipe = {"steps": [{"llama_cpp": {"type": "Q4_0", "mixed_precision": settings}}]}
    built, folder = _build_reading_only_calibration(recipe, planted_base, tmp_path, monkeypatch)
    plan = built.manifest.mixed_precision
    kept = {m["node"] for m in plan["matrices"] if m["bits"] == 8}
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert kept == {f"blk.1.{name}.weight" for name in names}, plan
    assert plan["measured_ppl_increase"] <= 0.01 < plan["int4_ppl_increase"]
    stored = tensor_types(folder / "model.gguf")
    assert {m["node"]: stored[m["node"]] for m in plan["matrices"]} == {
        m["node"]: "Q8_0" if m["node"] in kept else "Q4_0" for m in plan["matrices"]
    }
    assert "7 of 14 matrices kept at Q8_0" in " ".join(built.manifest.notes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_simulated_grid_is_onnxruntimes_blockwise_rounding(bits, symmetric):
    """What the search scores is what the export stores: fake quantization of a matrix equals onnxruntime's
    MatMulNBits quantizer (blocks of 32 inputs), dequantized, to float rounding."""
    import numpy as np
    import torch
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    torch.manual_seed(0)
    weight = torch.randn(48, 96)  # (out, in); MatMulNBits holds (in, out) in blocks along `in`
    weight[:, ::32] *= 20  # outliers, as in real checkpoints
    block, pack = 32, 8 // bits
    dense = np.ascontiguousarray(weight.numpy().T)
    inputs, outputs = dense.shape
    blocks = inputs // block
    packed = np.zeros((outputs, blocks, block // pack), dtype=np.uint8)
    scales = np.zeros((outputs, blocks), dtype=np.float32)
    zero_points = np.zeros((outputs, (blocks + pack - 1) // pack), dtype=np.uint8)
    quantize = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    quantize(packed, dense, scales, zero_points, block, outputs, inputs, symmetric)
    if bits == 4:
        levels = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(outputs, blocks, block)
        zero = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(outputs, -1)[:, :blocks]
    else:
        levels, zero = packed.reshape(outputs, blocks, block), zero_points
    zero = np.full_like(scales, 2 ** (bits - 1)) if symmetric else zero.astype(np.float32)
    dequantized = ((levels.astype(np.float32) - zero[..., None]) * scales[..., None]).reshape(outputs, inputs)
    simulated = fake_quantize(weight, bits, block, symmetric).numpy()
    assert np.abs(simulated - dequantized).max() < 1e-5
    assert np.abs(simulated - weight.numpy()).max() > 1e-3  # it does round


def test_every_exported_matrix_is_searched(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    matrices = export_matrices(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert [m.node for m in matrices][:5] == [
        f"/model/layers.0/{name}/MatMul" for name in ("attn/qkv_proj", "attn/o_proj", "mlp/gate_proj")
    ] + [f"/model/layers.0/mlp/{name}/MatMul" for name in ("up_proj", "down_proj")]
    assert len(matrices) == 11 and matrices[-1].node == "/lm_head/MatMul"


def test_gptq_rounds_onto_the_exports_own_grid_and_beats_round_to_nearest(planted_base):
    """GPTQ's output is a fixed point of onnxruntime's round-to-nearest (so the builder stores GPTQ's integers as
    they are), and on calibration inputs the layer's outputs stay closer to the float ones than with RTN."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.techniques.gptq_rounding import gptq_round, hessians

    model = AutoModelForCausalLM.from_pretrained(planted_base.path)
    tokenizer = AutoTokenizer.from_pretrained(planted_base.path)
    ids = tokenizer(" ".join(synthetic_sentences(200, seed=11)))["input_ids"]
    windows = [ids[i : i + 128] for i in range(0, 128 * 6, 128)]
    module = model.model.layers[0].mlp.down_proj
    hessian = hessians(model, {"down": module}, windows)["down"]
    weight = module.weight.detach()
    gptq = gptq_round(weight, hessian)
    assert torch.equal(fake_quantize(gptq, 4, 32, symmetric=True), gptq)
    rtn = fake_quantize(weight, 4, 32, symmetric=True)

    def output_error(rounded):  # E‖x(W − Q)ᵀ‖² over the calibration inputs = tr((W − Q) H (W − Q)ᵀ)
        difference = weight - rounded
        return torch.trace(difference @ hessian @ difference.T).item()

    assert output_error(gptq) < 0.8 * output_error(rtn)


def test_a_gptq_export_keeps_gptqs_weights_and_lowers_the_calibration_loss(planted_base, tmp_path):
    from tasks.techniques.optimize import build_variant

    calibration = [" ".join(synthetic_sentences(40, seed=s)) for s in range(6)]
    losses = {}
    for rounding in ("rtn", "gptq"):
        recipe = {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32, "rounding": rounding}}]}
        folder = tmp_path / rounding
        manifest = build_variant(
            rounding, VariantConfig.model_validate(recipe), planted_base, "d", folder, calibration
        )
        losses[rounding] = _held_out_loss(folder)
        if rounding == "gptq":
            assert "GPTQ rounding of 11 of 11 matrices" in " ".join(manifest.notes)
    assert losses["gptq"] < losses["rtn"]


def _held_out_loss(folder: Path) -> float:
    """Mean next-token loss of the exported model (ONNX Runtime GenAI) on text neither split had."""
    from tasks.engines import load_runtime

    runtime = load_runtime(folder, threads=1)
    ids = runtime.encode(" ".join(synthetic_sentences(60, seed=77)))
    scored = runtime.score([ids[i : i + 128] for i in range(0, 512, 128)])
    return sum(total for total, _ in scored) / sum(count for _, count in scored)


def test_the_per_layer_search_measures_only_what_can_change_the_plan(tiny_model_dir):
    """Each llama.cpp measurement quantizes and scores a whole model: when all-4-bit already meets the target no
    layer is measured, and a size budget with no room for one layer at Q8_0 is refused before anything is."""
    from transformers import AutoModelForCausalLM

    from tasks.techniques import gguf
    from tasks.techniques.mixed_precision import search

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    calls = []

    def measure(plan, quick=False):
        calls.append((plan, quick))
        return 2.0 if plan is None else 2.001  # all 4-bit: +0.1 % perplexity

    grouped = {
        "matrices": gguf.gguf_matrices(model),
        "measure": measure,
        "scale_bytes": gguf.SCALE_BYTES,
        "group": gguf.layer_of,
    }
    windows = [[1, 2, 3, 4]] * 4
    plan = search(model, windows, 0.02, 0.8, gguf.BLOCK, True, **grouped)
    assert (plan.stopped_by, plan.int8_nodes, [quick for _, quick in calls]) == (
        "target met",
        [],
        [False, False],
    )
    assert plan.tensor_types() == {}  # nothing overridden: llama.cpp's own choice for every tensor
    calls.clear()
    # all 4-bit is 52.9 % of the 8-bit bytes, one of the 2 layers at Q8_0 needs 76.5 %
    with pytest.raises(ValueError, match=r"size_budget: 0.7 leaves no room for any group .* needs 76.5%"):
        search(model, windows, 0.02, 0.7, gguf.BLOCK, True, **grouped)
    assert calls == []

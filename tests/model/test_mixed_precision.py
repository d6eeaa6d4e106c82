"""Accuracy-aware mixed precision: a planted sensitive matrix stays int8 in the exported graph, every other matrix
goes to int4, and the search sees the calibration split only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.cluster import Stored, Workspace
from flows.stages import Inputs, build_task
from tasks.config import TargetConfig
from tasks.engines.onnx.export import weight_bits
from tasks.inputs.data import write_splits
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.params import VariantConfig
from tasks.techniques.mixed_precision import export_matrices, fake_quantize
from tests.factories import synthetic_sentences

# torch kernels sum in other orders per instruction set: `make test` runs these again on a second one
pytestmark = pytest.mark.numerics

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
    return _planted(tiny_model_dir, tmp_path_factory.mktemp("planted"), torch.float32)


@pytest.fixture(scope="module")
def planted_base_float64(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, one_torch_thread
) -> PreparedBase:
    """The same planted model trained in float64 (saved in float32), for comparisons between roundings whose
    margins are small: float32 training drifts apart between CPUs (their kernels sum in other orders and 150 Adam
    steps amplify it), so which rounding wins on `planted_base` depends on the machine (weighted scales against
    plain GPTQ: 1.2166 against 1.2160 on a Xeon with AVX-512, the other way round on an EPYC with AVX2)."""
    return _planted(tiny_model_dir, tmp_path_factory.mktemp("planted64"), torch.float64)


def _planted(tiny_model_dir: Path, folder: Path, dtype: torch.dtype) -> PreparedBase:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(dtype)
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
    model.float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return PreparedBase(folder, folder_sha256(folder), "planted")


def _meets_the_recipe_target(plan: dict) -> None:
    """The search stopped because its measured plan met the recipe's target (+1 % calibration perplexity), which
    all-int4 misses: the search's own promise, whatever the kernels' arithmetic (measured +0.5 % with one matrix kept
    on the Xeon with AVX-512 and both EPYCs the suite ran on)."""
    assert plan["stopped_by"] == "target met", plan
    assert plan["measured_ppl_increase"] <= plan["target_ppl_increase"] < plan["int4_ppl_increase"], plan


def _keeping_the_planted_layer_pays(plan: dict) -> None:
    """With room for one layer at 8 bits, keeping the planted one removes most of all-int4's damage: at least three
    quarters of the perplexity increase, both measured by the same kernels. The planted outliers (every 32nd input
    ×100) make int4 round the rest of their blocks to zero, so that layer holds most of the damage (all-int4 +7.4 %,
    the plan +0.7 % on a Xeon with AVX-512; +1.05 % on an EPYC with AVX-512). Not a fixed figure: how far the plan
    lands from the +1 % target moves with the CPU's int4/Q4_0 kernels and the planted model trained in float32."""
    assert plan["target_ppl_increase"] < plan["int4_ppl_increase"], plan  # the search had something to keep
    assert plan["measured_ppl_increase"] <= plan["int4_ppl_increase"] / 4, plan


def _build_reading_only_calibration(recipe, planted_base, tmp_path, monkeypatch):
    """Build `recipe` on the planted model through the optimize stage; the search must see calibration text only
    (the evaluation split holds words the calibration split never has)."""
    import tasks.techniques.mixed_precision_search as mixed_precision

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
    built = build_task.fn("mixed", VariantConfig.model_validate(recipe), inputs, Workspace(tmp_path / "work"))

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
    _meets_the_recipe_target(plan)
    exported = weight_bits(folder)
    assert exported.pop(PLANTED) == 8
    embedding = "/model/embed_tokens/GatherBlockQuantized"  # still the int4 table shared with the lm_head
    assert exported == {embedding: 4} | {m["node"]: 4 for m in plan["matrices"] if m["node"] != PLANTED}
    assert "1 of 11 matrices kept at int8" in " ".join(built.manifest.notes)


def test_an_int8_lm_head_is_kept_from_the_start_and_the_search_chooses_the_rest(
    planted_base, tmp_path, monkeypatch
):
    """`lm_head: int8` with mixed precision: the tied lm_head (whose Fisher cost sees only its output role) is at
    int8 before the search starts, its bytes out of the budget; the search still finds the planted matrix, and the
    embedding lookup reads the int8 lm_head's table. A budget without room for the lm_head is refused naming it."""
    step = RECIPE["steps"][0]["onnx_genai"]
    recipe = {
        "steps": [
            {
                "onnx_genai": step
                | {"lm_head": "int8", "mixed_precision": step["mixed_precision"] | {"size_budget": 1.0}}
            }
        ]
    }
    built, folder = _build_reading_only_calibration(recipe, planted_base, tmp_path, monkeypatch)
    plan = built.manifest.mixed_precision
    kept = [m["node"] for m in plan["matrices"] if m["bits"] == 8]
    assert {PLANTED, "/lm_head/MatMul"} <= set(kept) and len(kept) < len(plan["matrices"]) / 2, plan
    _meets_the_recipe_target(plan)
    exported = weight_bits(folder)
    assert exported.pop("/model/embed_tokens/GatherBlockQuantized") == 8  # the lm_head's int8 table, shared
    assert exported == {m["node"]: m["bits"] for m in plan["matrices"]}

    from transformers import AutoModelForCausalLM

    from tasks.techniques.mixed_precision_search import Goal, Grid, search

    model = AutoModelForCausalLM.from_pretrained(planted_base.path)
    with pytest.raises(ValueError, match=r"size_budget: 0.6 leaves no room for /lm_head/MatMul at 8 bits"):
        search(model, [[1, 2, 3, 4]], Goal(0.01, 0.6, frozenset({"/lm_head/MatMul"})), Grid(32, True))


def test_a_measured_onnx_search_keeps_the_planted_layer_whole(planted_base, tmp_path, monkeypatch):
    """`sensitivity: measured`: each decoder layer (and the lm_head) goes to int8 alone and its saving is measured,
    not predicted; the layer holding the planted matrix is kept whole, the other layer and the lm_head stay int4."""
    step = RECIPE["steps"][0]["onnx_genai"]
    mixed = step["mixed_precision"] | {"sensitivity": "measured", "size_budget": 0.8}
    built, folder = _build_reading_only_calibration(
        {"steps": [{"onnx_genai": step | {"mixed_precision": mixed}}]}, planted_base, tmp_path, monkeypatch
    )
    plan = built.manifest.mixed_precision
    kept = {m["node"] for m in plan["matrices"] if m["bits"] == 8}
    assert kept == {m["node"] for m in plan["matrices"] if m["node"].startswith("/model/layers.1/")}, plan
    assert PLANTED in kept and plan["sensitivity"] == "measured per layer"
    _keeping_the_planted_layer_pays(plan)
    exported = weight_bits(folder)
    assert {node: exported[node] for node in exported if node in kept} == dict.fromkeys(kept, 8)
    with pytest.raises(ValueError, match="llama.cpp's plans are measured per layer"):
        VariantConfig.model_validate(
            {"steps": [{"llama_cpp": {"type": "Q4_0", "mixed_precision": {"sensitivity": "predicted"}}}]}
        )


def test_llama_cpp_keeps_the_planted_layer_at_q8_0_and_the_rest_at_q4_0_using_calibration_text_only(
    planted_base, tmp_path, monkeypatch
):
    """In llama.cpp the search measures each layer at Q8_0 and each plan in llama.cpp itself: the layer holding
    the planted matrix is kept, the other goes to Q4_0, and the GGUF stores exactly that."""
    from tasks.engines.llama_cpp.gguf import tensor_types

    settings = RECIPE["steps"][0]["onnx_genai"]["mixed_precision"] | {
        "size_budget": 0.8
    }  # one of 2 layers fits
    recipe = {"steps": [{"llama_cpp": {"type": "Q4_0", "mixed_precision": settings}}]}
    built, folder = _build_reading_only_calibration(recipe, planted_base, tmp_path, monkeypatch)
    plan = built.manifest.mixed_precision
    kept = {m["node"] for m in plan["matrices"] if m["bits"] == 8}
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert kept == {f"blk.1.{name}.weight" for name in names}, plan
    _keeping_the_planted_layer_pays(plan)
    stored = tensor_types(folder / "model.gguf")
    assert {m["node"]: stored[m["node"]] for m in plan["matrices"]} == {
        m["node"]: "Q8_0" if m["node"] in kept else "Q4_0" for m in plan["matrices"]
    }
    assert "7 of 14 matrices kept at Q8_0" in " ".join(built.manifest.notes)


def test_llama_cpp_ranks_layers_on_its_torch_twin_and_measures_only_the_plans(
    planted_base, tmp_path, monkeypatch
):
    """`sensitivity: simulated`: each layer's saving at Q8_0 comes from the torch twin of Q4_0 with an importance
    matrix (no llama.cpp quantization per layer), the plans from llama.cpp; the planted layer is still the one
    kept, and llama.cpp quantized a trial GGUF only for the plans."""
    from tasks.engines.llama_cpp import gguf
    from tasks.engines.llama_cpp.gguf import tensor_types

    trials = []
    real_quantize = gguf.quantize_gguf

    def quantize(source, dest, *args, **kwargs):
        if dest.name == "plan.gguf":
            trials.append(dict(kwargs.get("tensor_types") or {}))
        return real_quantize(source, dest, *args, **kwargs)

    monkeypatch.setattr(gguf, "quantize_gguf", quantize)
    settings = RECIPE["steps"][0]["onnx_genai"]["mixed_precision"] | {
        "size_budget": 0.8,
        "sensitivity": "simulated",
    }
    recipe = {"steps": [{"llama_cpp": {"type": "Q4_0", "imatrix": True, "mixed_precision": settings}}]}
    built, folder = _build_reading_only_calibration(recipe, planted_base, tmp_path, monkeypatch)
    plan = built.manifest.mixed_precision
    kept = {m["node"] for m in plan["matrices"] if m["bits"] == 8}
    assert {node.split(".")[1] for node in kept} == {"1"} and len(kept) == 7, plan
    assert plan["sensitivity"].startswith("simulated per layer")
    _keeping_the_planted_layer_pays(plan)
    assert len(trials) == 2  # all-Q4_0 and the one plan; per layer it would have been 2 more
    stored = tensor_types(folder / "model.gguf")
    assert all(stored[node] == "Q8_0" for node in kept)
    with pytest.raises(ValueError, match="simulated has a torch twin for type Q4_0 with imatrix: true only"):
        VariantConfig.model_validate(
            {"steps": [{"llama_cpp": {"type": "Q4_0", "mixed_precision": settings}}]}
        )


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
    # the same grid and scales computed twice in float32: one rounding decision apart would be a whole step
    # (~1e-2 on these weights), float rounding of the scales ~1e-9
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
    gptq = gptq_round(weight, hessian).dequantized()
    assert torch.equal(fake_quantize(gptq, 4, 32, symmetric=True), gptq)
    rtn = fake_quantize(weight, 4, 32, symmetric=True)

    def output_error(rounded):  # E‖x(W − Q)ᵀ‖² over the calibration inputs = tr((W − Q) H (W − Q)ᵀ)
        difference = weight - rounded
        return torch.trace(difference @ hessian @ difference.T).item()

    assert output_error(gptq) < 0.8 * output_error(rtn)


@pytest.mark.parametrize("seed", range(40))
def test_weighted_scales_never_raise_the_weighted_error_over_round_to_nearest(seed):
    """Property: for any block (outliers, zeros, a constant block) and any importance (zeros included), the
    searched scale's importance-weighted error is at most round-to-nearest's, and below it in total."""
    from tasks.techniques.gptq_rounding import weighted_round

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 96, generator=generator) * torch.rand(64, 1, generator=generator)
    weight[:, torch.randint(0, 96, (4,), generator=generator)] *= 30  # outlier columns
    weight[0] = 0  # an all-zero row
    weight[1, :32] = 0.5  # a constant block
    importance = torch.rand(96, generator=generator) ** 4 * 100
    importance[torch.randint(0, 96, (8,), generator=generator)] = 0
    importance[64:] = 0 if seed % 5 == 0 else importance[64:]  # a block nobody reads

    def block_errors(rounded):
        error = importance * (weight - rounded) ** 2
        return error.reshape(64, 3, 32).sum(-1)

    searched = block_errors(weighted_round(weight, importance).dequantized())
    nearest = block_errors(fake_quantize(weight, 4, 32, symmetric=True))
    assert (searched <= nearest * (1 + 1e-5) + 1e-9).all()
    assert searched.sum() < nearest.sum()  # a search that kept round-to-nearest's scales fails here


def test_int4_levels_and_scales_pack_into_matmulnbits_bytes_and_back(tmp_path):
    """MatMulNBits' layout: two levels a byte, low nibble first, level + 8; a ragged last block padded with 0."""
    import numpy as np

    from tasks.engines.onnx.weights import pack_int4
    from tasks.techniques.gptq_rounding import BlockwiseInt

    levels = torch.randint(-8, 8, (5, 40), dtype=torch.int8)
    packed, scales = pack_int4(BlockwiseInt(levels, torch.rand(5, 2), 32))
    assert packed.shape == (5, 2, 16) and packed.dtype == np.uint8 and scales.shape == (5, 2)
    unpacked = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(5, 64).astype(int) - 8
    assert (unpacked[:, :40] == levels.numpy()).all() and (unpacked[:, 40:] == 0).all()


def _build(planted_base, tmp_path, name, **settings):
    from tasks.techniques.build import build_variant

    calibration = [" ".join(synthetic_sentences(40, seed=s)) for s in range(6)]
    recipe = {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32, **settings}}]}
    folder = tmp_path / name
    manifest = build_variant(
        name, VariantConfig.model_validate(recipe), planted_base, "d", folder, calibration
    )
    return folder, manifest, calibration


def test_the_export_holds_exactly_the_planned_integers_and_scales_and_runs_on_them(planted_base, tmp_path):
    """Every int4 node of a GPTQ + weighted-scales export holds the levels and scales computed from the calibration
    split (recomputed here), and onnxruntime's logits are the torch model's with those weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.engines import load_runtime
    from tasks.engines.onnx.weights import read_int4
    from tasks.techniques.build import BuildContext
    from tasks.techniques.calibration import WINDOW_TOKENS
    from tasks.techniques.gptq_rounding import round_matrices

    folder, manifest, calibration = _build(
        planted_base, tmp_path, "weighted", rounding="gptq", scales="weighted", accuracy_level=0
    )
    assert "GPTQ rounding with importance-weighted scales of 11 matrices" in " ".join(manifest.notes)
    assert _accuracy_levels(folder) == {0}  # as asked: the builder's own default on CPU would be 4
    model = AutoModelForCausalLM.from_pretrained(planted_base.path)
    tokenizer = AutoTokenizer.from_pretrained(planted_base.path)
    windows = BuildContext(calibration, tmp_path).sequences(tokenizer, WINDOW_TOKENS, 32)
    modules = dict(model.named_modules())
    matrices = export_matrices(model)
    planned = round_matrices(
        model, {n: modules[n] for m in matrices for n in m.modules}, windows, 32, "gptq", "weighted"
    )
    stored = read_int4(folder, [m.node for m in matrices])
    for matrix in matrices:
        held = stored[matrix.node]
        assert torch.equal(held.levels, torch.cat([planned[n].levels for n in matrix.modules])), matrix.node
        assert torch.equal(held.scales, torch.cat([planned[n].scales for n in matrix.modules])), matrix.node
    with torch.no_grad():
        for name, weights in planned.items():
            modules[name].weight.copy_(weights.dequantized())
    ids = tokenizer(" ".join(synthetic_sentences(30, seed=77)))["input_ids"][:96]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    ((total, count),) = load_runtime(folder, TargetConfig(threads=1)).score([ids])
    # accuracy_level 0: ONNX Runtime multiplies in float32 as torch does, so the two differ only in summation
    # order (2.6e-7 at most on this model, measured with torch on three instruction sets). 1e-5 is ~100 float32
    # epsilons; int8 activations (accuracy_level 4) moved the loss 2e-4 to 2.2e-3, other weights more still
    assert total / count == pytest.approx(expected, rel=1e-5)


def _accuracy_levels(folder: Path) -> set[int]:
    """The accuracy_level of every MatMulNBits node of the exported graph (an absent attribute is 0)."""
    import onnx

    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    return {
        next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
        for node in graph.node
        if node.op_type == "MatMulNBits"
    }


def test_weighted_scales_beat_round_to_nearest_and_plain_gptq_on_calibration_loss(
    planted_base_float64, tmp_path
):
    """On the trained planted-outlier model: the calibration loss of the export (in onnxruntime) with GPTQ on
    importance-weighted scales is below round-to-nearest's and plain GPTQ's, and weighted scales alone are below
    round-to-nearest's."""
    losses = {}
    for name, settings in {
        "rtn": {},
        "gptq": {"rounding": "gptq"},
        "weighted_rtn": {"scales": "weighted"},
        "weighted": {"rounding": "gptq", "scales": "weighted"},
    }.items():
        folder, _, calibration = _build(planted_base_float64, tmp_path, name, **settings)
        losses[name] = _loss(folder, " ".join(calibration))
    assert losses["weighted"] < losses["gptq"] < losses["rtn"], losses
    assert losses["weighted_rtn"] < losses["rtn"], losses


def test_a_tied_int8_lm_head_shares_its_table_with_the_embedding_lookup(planted_base, tmp_path):
    """`lm_head: int8` on a tied model: the lm_head is int8 and the embedding lookup reads that same table
    (GatherBlockQuantized, 8 bits) instead of a float32 copy; the int4 embedding of the plain export is gone."""
    import onnx

    folder, manifest, _ = _build(planted_base, tmp_path, "head8", lm_head="int8")
    bits = weight_bits(folder)
    assert bits["/lm_head/MatMul"] == 8 and bits["/model/embed_tokens/GatherBlockQuantized"] == 8
    assert bits["/model/layers.0/mlp/down_proj/MatMul"] == 4
    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    assert not [node for node in graph.node if node.op_type == "Gather" and "embed" in node.name]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(planted_base.path)
    table = [config.vocab_size, config.hidden_size]
    floats = [
        i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and list(i.dims) == table
    ]
    assert not floats, floats  # no float32 copy of the embedding table
    assert "the embedding lookup reads the tied int8 lm_head's table" in " ".join(manifest.notes)
    plain, _, _ = _build(planted_base, tmp_path, "plain")
    text = " ".join(synthetic_sentences(60, seed=77))
    assert _loss(folder, text) < _loss(plain, text)
    int8, manifest, _ = _build(
        planted_base, tmp_path, "int8", precision="int8"
    )  # an int8 export shares it too
    assert weight_bits(int8)["/model/embed_tokens/GatherBlockQuantized"] == 8
    assert "the embedding lookup reads the tied int8 lm_head's table" in " ".join(manifest.notes)


def _loss(folder: Path, text: str) -> float:
    from tasks.engines import load_runtime

    runtime = load_runtime(folder, TargetConfig(threads=1))
    ids = runtime.encode(text)
    scored = runtime.score([ids[i : i + 128] for i in range(0, min(len(ids), 1024) - 8, 128)])
    return sum(total for total, _ in scored) / sum(count for _, count in scored)


def _held_out_loss(folder: Path) -> float:
    """Mean next-token loss of the exported model (ONNX Runtime GenAI) on text neither split had."""
    from tasks.engines import load_runtime

    runtime = load_runtime(folder, TargetConfig(threads=1))
    ids = runtime.encode(" ".join(synthetic_sentences(60, seed=77)))
    scored = runtime.score([ids[i : i + 128] for i in range(0, 512, 128)])
    return sum(total for total, _ in scored) / sum(count for _, count in scored)


def test_the_per_layer_search_measures_only_what_can_change_the_plan(tiny_model_dir):
    """Each llama.cpp measurement quantizes and scores a whole model: when all-4-bit already meets the target no
    layer is measured, and a size budget with no room for one layer at Q8_0 is refused before anything is."""
    from transformers import AutoModelForCausalLM

    from tasks.engines.llama_cpp import gguf
    from tasks.techniques.mixed_precision_search import Goal, Grid, search

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    calls = []

    def measure(plan, quick=False):
        calls.append((plan, quick))
        return 2.0 if plan is None else 2.001  # all 4-bit: +0.1 % perplexity

    grouped = {
        "matrices": gguf.gguf_matrices(model),
        "measure": measure,
        "group": gguf.layer_of,
    }
    grid = Grid(gguf.BLOCK, True, scale_bytes=gguf.SCALE_BYTES)
    windows = [[1, 2, 3, 4]] * 4
    plan = search(model, windows, Goal(0.02, 0.8), grid, **grouped)
    assert (plan.stopped_by, plan.int8_nodes, [quick for _, quick in calls]) == (
        "target met",
        [],
        [False, False],
    )
    assert plan.tensor_types() == {}  # nothing overridden: llama.cpp's own choice for every tensor
    calls.clear()
    # all 4-bit is 52.9 % of the 8-bit bytes, one of the 2 layers at Q8_0 needs 76.5 %
    with pytest.raises(ValueError, match=r"size_budget: 0.7 leaves no room for any group .* needs 76.5%"):
        search(model, windows, Goal(0.02, 0.7), grid, **grouped)
    assert calls == []


def test_the_fisher_diagonal_is_computed_once_per_base_and_windows(tiny_model_dir, tmp_path, monkeypatch):
    """Inside the statistics cache a second search on the same model and windows reads the Fisher diagonal back
    (same plan, no gradient pass); other windows or a changed weight compute it again."""
    from transformers import AutoModelForCausalLM

    import tasks.techniques.mixed_precision_search as mixed_precision
    from tasks.techniques.calibration import statistics_cache
    from tasks.techniques.mixed_precision_search import Goal, Grid

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    passes = []
    real = mixed_precision.fisher_diagonal

    def fisher(*args):
        passes.append(1)
        return real(*args)

    monkeypatch.setattr(mixed_precision, "fisher_diagonal", fisher)
    windows = [[5, 9, 2, 7, 3, 8, 1, 4] * 4] * 2
    with statistics_cache(tmp_path / "stats"):
        first = mixed_precision.search(model, windows, Goal(0.001, 1.0), Grid(32, True))
        second = mixed_precision.search(model, windows, Goal(0.001, 1.0), Grid(32, True))
        assert len(passes) == 1 and first.to_dict() == second.to_dict()
        mixed_precision.search(model, windows[:1], Goal(0.001, 1.0), Grid(32, True))
        assert len(passes) == 2
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
        mixed_precision.search(model, windows, Goal(0.001, 1.0), Grid(32, True))
        assert len(passes) == 3


def test_rounded_matrices_are_computed_once_per_base_windows_and_settings(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The int4 export and the mixed-precision export of one base round the same matrices the same way: inside the
    statistics cache the second reads the levels and scales back; other settings round again."""
    from transformers import AutoModelForCausalLM

    import tasks.techniques.gptq_rounding as gptq_rounding
    from tasks.techniques.calibration import statistics_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    modules = {"down": model.model.layers[0].mlp.down_proj, "up": model.model.layers[1].mlp.up_proj}
    windows = [[5, 9, 2, 7, 3, 8, 1, 4] * 4] * 2
    runs = []
    real = gptq_rounding._round_matrices

    def counting(*args):
        runs.append(args[4:6])
        return real(*args)

    monkeypatch.setattr(gptq_rounding, "_round_matrices", counting)
    with statistics_cache(tmp_path / "stats"):
        first = gptq_rounding.round_matrices(model, modules, windows, 32, "rtn", "weighted")
        again = gptq_rounding.round_matrices(model, modules, windows, 32, "rtn", "weighted")
        assert runs == [("rtn", "weighted")]
        for name in modules:
            assert torch.equal(first[name].levels, again[name].levels)
            assert torch.equal(first[name].scales, again[name].scales) and again[name].block == 32
        gptq_rounding.round_matrices(model, modules, windows, 32, "gptq", "weighted")
        gptq_rounding.round_matrices(model, modules, windows, 16, "rtn", "weighted")
        assert len(runs) == 3


def test_a_layers_saving_measured_from_its_cached_inputs_is_the_full_pass_s(planted_base, monkeypatch):
    """The measured search runs each decoder layer's 8-bit trial from the cached inputs of that layer: every unit's
    saving, and so the plan, is exactly what full passes give (the shortcut is checked at run time too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.techniques import sensitivity
    from tasks.techniques.mixed_precision import export_layer_of
    from tasks.techniques.mixed_precision_search import Goal, Grid, search
    from tasks.techniques.sensitivity import LayerSuffixes

    model = AutoModelForCausalLM.from_pretrained(planted_base.path).eval()
    ids = AutoTokenizer.from_pretrained(planted_base.path)(" ".join(synthetic_sentences(200, seed=8)))[
        "input_ids"
    ]
    windows = [ids[i : i + 64] for i in range(0, 64 * 8, 64)]
    run = lambda: search(model, windows, Goal(0.001, 0.9), Grid(32, True), group=export_layer_of)  # noqa: E731
    shortcuts = []
    real_loss = LayerSuffixes.loss
    monkeypatch.setattr(
        LayerSuffixes, "loss", lambda self, start: shortcuts.append(start) or real_loss(self, start)
    )
    shortcut = run()
    assert sorted(shortcuts) == [
        0,
        1,
        1,
    ]  # layer 1 checked against a full pass, then each layer from its inputs
    monkeypatch.undo()
    monkeypatch.setattr(LayerSuffixes, "agrees", lambda *_: False)  # full passes only
    full = run()
    assert [(c.node, c.bits) for c in shortcut.matrices] == [(c.node, c.bits) for c in full.matrices]
    for a, b in zip(shortcut.matrices, full.matrices, strict=True):
        assert a.int4_cost == pytest.approx(b.int4_cost, rel=1e-6, abs=1e-9)
    assert any(c.int4_cost != 0 for c in full.matrices)
    # a layer that depends on more than its input (here: its position in the stack) is caught, and not shortcut
    calls = []
    real = sensitivity.LayerSuffixes.loss
    monkeypatch.undo()
    monkeypatch.setattr(
        LayerSuffixes, "loss", lambda self, start: calls.append(start) or real(self, start) + 1.0
    )
    assert [(c.node, c.bits) for c in run().matrices] == [(c.node, c.bits) for c in full.matrices]
    assert len(calls) == 1  # the check only
    monkeypatch.undo()
    model.config.layer_types = [
        "sliding_attention",
        "full_attention",
    ]  # layers picked by index: never shortcut
    assert not LayerSuffixes.usable(model, windows)
    model.config.layer_types = ["full_attention"] * 2
    assert LayerSuffixes.usable(model, windows)
    monkeypatch.setattr(LayerSuffixes, "MAX_CACHED_BYTES", 1000)
    assert not LayerSuffixes.usable(model, windows)  # too many layer inputs to keep

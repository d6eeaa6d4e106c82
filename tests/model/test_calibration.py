"""The one calibration capture: what it sums is what the model's modules saw, its hooks do not outlive it, and
every technique that calibrates reads its window count from its own setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.engines.onnx.export import OnnxGenAIStep, _calibrated_int4
from tasks.params import VariantConfig
from tasks.techniques.build import BuildContext
from tasks.techniques.calibration import (
    WINDOW_TOKENS,
    calibration_device,
    capture_inputs,
    compute_device,
    mean_square,
    unit_token_gram,
)
from tasks.techniques.prune import Prune, PruneStep
from tasks.techniques.quantize.step import Quantize, QuantizeStep
from tests.factories import synthetic_sentences

# torch kernels sum in other orders per instruction set: `make test` runs these again on a second one
pytestmark = pytest.mark.numerics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class CountingContext(BuildContext):
    """The build context, recording the window count and length every calibration request asked for."""

    def __init__(self, tokenizer, checkpoints: Path) -> None:
        super().__init__(synthetic_sentences(600, seed=3), checkpoints, tokenizer=tokenizer)
        self.requests: list[tuple[int, int | None]] = []

    def sequences(self, tokenizer, length: int, limit: int | None = None) -> list[list[int]]:
        self.requests.append((length, limit))
        return super().sequences(tokenizer, length, limit)


def test_the_capture_sums_exactly_the_inputs_the_modules_saw_and_removes_its_hooks(model, tokenizer):
    windows = [tokenizer(text)["input_ids"] for text in synthetic_sentences(3, seed=1)]
    found = capture_inputs(model, {"lm_head": model.lm_head}, windows, lambda rows: rows.double().sum(0))
    with torch.no_grad():  # lm_head's input is the final norm's output: the last hidden state
        last = [model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0] for ids in windows]
    expected = sum(hidden.double().sum(0) for hidden in last)
    assert found.tokens == sum(len(ids) for ids in windows)
    assert torch.allclose(found.sums["lm_head"], expected)
    assert torch.allclose(found.means()["lm_head"], expected / found.tokens)
    assert not model.lm_head._forward_hooks


def test_a_cuda_target_calibrates_where_torch_sees_a_gpu_else_on_the_cpu_with_the_same_sums(model, tokenizer):
    """A build for a cuda target asks for calibration on the GPU (`calibration_device`); where torch sees none
    (this machine, or a worker without one) it runs on the CPU as before, and the sums come back on the CPU."""
    windows = [tokenizer(text)["input_ids"] for text in synthetic_sentences(2, seed=1)]
    modules = {"lm_head": model.lm_head}
    plain = capture_inputs(model, modules, windows, mean_square)
    with calibration_device("meta"):  # a device any torch has: the block's device is the one asked for
        assert compute_device().type == "meta"
    with calibration_device("cuda"):
        where = compute_device()
        found = capture_inputs(model, modules, windows, mean_square)
    assert where.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert compute_device().type == "cpu"  # outside the block: the default again
    assert found.sums["lm_head"].device.type == "cpu" and next(model.parameters()).device.type == "cpu"
    assert torch.allclose(found.sums["lm_head"], plain.sums["lm_head"])


def test_a_device_without_room_for_the_model_calibrates_where_the_model_is(
    model, tokenizer, monkeypatch, caplog
):
    """The model is moved to the calibration device for the capture and back after; a device that runs out of
    memory on the move leaves it where it was (moved back, logged) and the capture runs there, with the same sums."""
    windows = [tokenizer(text)["input_ids"] for text in synthetic_sentences(2, seed=1)]
    modules = {"lm_head": model.lm_head}
    plain = capture_inputs(model, modules, windows, mean_square)
    moves, move = [], model.to

    def to(device, *args, **kwargs):
        moves.append(str(device))
        if str(device) == "meta":
            raise torch.OutOfMemoryError("no room")
        return move(device, *args, **kwargs)

    monkeypatch.setattr(model, "to", to)
    with calibration_device("meta"), caplog.at_level("WARNING"):
        found = capture_inputs(model, modules, windows, mean_square)
    assert moves == ["meta", "cpu", "cpu"]  # tried, back at once, back again after the block
    assert "meta has no room for the model; on cpu" in caplog.text
    assert torch.allclose(found.sums["lm_head"], plain.sums["lm_head"])


def test_the_capture_removes_its_hooks_when_a_window_fails(model):
    with pytest.raises(IndexError):
        capture_inputs(model, {"lm_head": model.lm_head}, [[1, 2, 3], [10**6]], mean_square)
    assert not model.lm_head._forward_hooks


def test_the_gram_statistic_weighs_every_token_alike():
    rows = torch.tensor([[3.0, 4.0], [300.0, 400.0]])  # one token a hundred times the other, same direction
    assert torch.allclose(
        unit_token_gram(rows), 2 * torch.tensor([[0.36, 0.48], [0.48, 0.64]], dtype=torch.double)
    )


@pytest.mark.parametrize(
    ("technique", "settings"),
    [
        (Prune(), PruneStep(method="structured", mlp_fraction=0.25, calibration_windows=2)),
        (Quantize(), QuantizeStep(method="quanto_w8a8", calibration_windows=2)),
    ],
    ids=["prune", "quanto_w8a8"],
)
def test_a_calibrating_step_reads_its_window_count_from_its_setting(
    model, tokenizer, tmp_path, technique, settings
):
    context = CountingContext(tokenizer, tmp_path)
    technique.apply(model, settings, context)
    assert context.requests == [(WINDOW_TOKENS, 2)]


@pytest.mark.parametrize("spelling", ["calibration_windows", "gptq_windows"])
def test_int4_rounding_reads_its_window_count_from_its_setting(model, tokenizer, tmp_path, spelling):
    context, notes = CountingContext(tokenizer, tmp_path), []
    step = OnnxGenAIStep.model_validate({"rounding": "gptq", "scales": "weighted", spelling: 2})
    _calibrated_int4(model, step, context, notes)
    assert context.requests == [(WINDOW_TOKENS, 2)]
    assert f"on {2 * WINDOW_TOKENS:,} calibration tokens" in notes[0]


@pytest.mark.parametrize(
    ("step", "named"),
    [
        (
            {"onnx_genai": {"precision": "int4", "calibration_windows": 8}},
            "calibration_windows applies only with rounding: gptq or scales: weighted",
        ),
        (
            {
                "prune": {
                    "method": "structured",
                    "mlp_fraction": 0.25,
                    "importance": "magnitude",
                    "calibration_windows": 8,
                }
            },
            "calibration_windows applies to method structured with importance activation",
        ),
        (
            {"quantize": {"method": "quanto_w8a16", "calibration_windows": 8}},
            "calibration_windows applies to quanto_w8a8",
        ),
        (
            {"llama_cpp": {"type": "Q4_0", "imatrix_windows": 8}},
            "imatrix_windows applies only with imatrix: true",
        ),
    ],
    ids=["gptq", "prune", "quanto", "imatrix"],
)
def test_a_window_count_is_refused_where_nothing_calibrates(step, named):
    with pytest.raises(ValueError, match=named):
        VariantConfig.model_validate({"steps": [step]})


def test_window_counts_left_unset_keep_recipe_hashes():
    explicit = VariantConfig.model_validate({"steps": [{"onnx_genai": {"rounding": "gptq"}}]})
    assert "calibration_windows" not in str(explicit.recipe())


def test_a_calibration_split_with_no_windows_is_one_clear_error(model):
    from tasks.errors import BuildError

    with pytest.raises(BuildError, match="the calibration split gave no token windows"):
        capture_inputs(model, {"lm_head": model.lm_head}, [], mean_square)


def test_modules_reading_one_input_share_its_statistic_and_each_gets_the_full_sum(model, tokenizer):
    """q, k and v read the same input: computed once, summed into each (equal to hooking q alone); o_proj, called
    right after, reads another and gets its own."""
    windows = [tokenizer(text)["input_ids"] for text in synthetic_sentences(3, seed=1)]
    attn = model.model.layers[0].self_attn
    calls = []

    def counted(rows):
        calls.append(1)
        return mean_square(rows)

    hooked = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
    together = capture_inputs(model, hooked, windows, counted)
    alone = {name: capture_inputs(model, {name: hooked[name]}, windows, mean_square) for name in ("q", "o")}
    assert len(calls) == 2 * len(windows)  # q/k/v's one input, o's own
    for name in "qkv":
        assert torch.equal(together.sums[name], alone["q"].sums["q"])
    assert torch.equal(together.sums["o"], alone["o"].sums["o"])
    assert not torch.equal(together.sums["o"], together.sums["q"][: together.sums["o"].shape[0]])


def test_a_capture_is_read_back_for_the_same_inputs_and_run_again_when_any_changes(
    model, tokenizer, tmp_path, monkeypatch
):
    """Content-addressed: same weights, modules, windows and statistics → read from the cache (the model does
    not run); a changed weight, window, module set or statistic → captured afresh."""
    import tasks.techniques.calibration as calibration

    windows = [tokenizer(text)["input_ids"] for text in synthetic_sentences(4, seed=2)]
    mlp = model.model.layers[1].mlp
    runs = []
    real_capture = calibration._capture

    def counting(*args):
        runs.append(1)
        return real_capture(*args)

    monkeypatch.setattr(calibration, "_capture", counting)
    with calibration.statistics_cache(tmp_path / "stats"):

        def capture(modules=None, ids=windows, statistic=mean_square):
            found = capture_inputs(model, modules or {"down": mlp.down_proj}, ids, statistic)
            return found.sums["down" if "down" in (modules or {"down": 0}) else "up"]

        first = capture()
        assert len(runs) == 1 and len(list((tmp_path / "stats").glob("*.pt"))) == 1
        assert torch.equal(capture(), first) and len(runs) == 1  # read back
        capture(ids=windows[:3])
        assert len(runs) == 2  # other windows (the data or the window count changed)
        capture(modules={"up": mlp.up_proj})
        assert len(runs) == 3  # other modules
        capture(statistic=unit_token_gram)
        assert len(runs) == 4  # another statistic
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3  # another base (or an earlier step's)
        assert not torch.equal(capture(), first) and len(runs) == 5
    capture_inputs(model, {"down": mlp.down_proj}, windows, mean_square)
    assert len(runs) == 6  # outside the block nothing is cached


def test_the_importance_matrix_reuses_the_onnx_weighted_scales_capture(
    model, tokenizer, tmp_path, monkeypatch
):
    """llama.cpp's importance matrix and the ONNX export's importance-weighted scales read the same statistic of
    the same inputs: with the statistics cache one calibration pass serves both (either order)."""
    import tasks.techniques.calibration as calibration
    from tasks.engines.llama_cpp import gguf

    runs = []
    real_capture = calibration._capture
    monkeypatch.setattr(calibration, "_capture", lambda *args: runs.append(1) or real_capture(*args))
    export = OnnxGenAIStep(precision="int4", scales="weighted")
    context = BuildContext(synthetic_sentences(600, seed=3), tmp_path / "checkpoints", tokenizer=tokenizer)
    windows = context.sequences(tokenizer, WINDOW_TOKENS, limit=32)
    uncached = gguf.importance_matrix(model, windows)
    with calibration.statistics_cache(tmp_path / "stats"):
        _calibrated_int4(model, export, context, [])
        assert len(runs) == 2  # the uncached one, then the export's
        cached = gguf.importance_matrix(model, windows)
    assert len(runs) == 2  # read back
    assert cached == uncached and "blk.0.attn_q.weight" in cached and "output.weight" not in cached

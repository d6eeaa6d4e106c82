"""The one calibration capture: what it sums is what the model's modules saw, its hooks do not outlive it, and
every technique that calibrates reads its window count from its own setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.config import VariantConfig
from tasks.techniques.calibration import WINDOW_TOKENS, capture_inputs, mean_square, unit_token_gram
from tasks.techniques.onnx_export import OnnxGenAIStep, _gptq_rounding
from tasks.techniques.optimize import BuildContext
from tasks.techniques.prune import Prune, PruneStep
from tasks.techniques.quantize import Quantize, QuantizeStep
from tests.factories import synthetic_sentences

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


def test_gptq_rounding_reads_its_window_count_from_its_setting(model, tokenizer, tmp_path):
    context = CountingContext(tokenizer, tmp_path)
    note = _gptq_rounding(model, OnnxGenAIStep(rounding="gptq", gptq_windows=2), None, context)
    assert context.requests == [(WINDOW_TOKENS, 2)]
    assert f"on {2 * WINDOW_TOKENS:,} calibration tokens" in note


@pytest.mark.parametrize(
    ("step", "named"),
    [
        (
            {"onnx_genai": {"precision": "int4", "gptq_windows": 8}},
            "gptq_windows applies only with rounding: gptq",
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
    assert "gptq_windows" not in str(explicit.recipe())


def test_a_calibration_split_with_no_windows_is_one_clear_error(model):
    from tasks.errors import BuildError

    with pytest.raises(BuildError, match="the calibration split gave no token windows"):
        capture_inputs(model, {"lm_head": model.lm_head}, [], mean_square)

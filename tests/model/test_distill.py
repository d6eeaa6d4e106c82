"""Distillation on tiny random Llamas: the student is a consistent shallower model, learns, resumes exactly, stops,
and is what an onnx_genai export after it carries."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tasks.techniques.distill import CHECKPOINT_FILE, DistillSettings, build_student, distill, student_layers
from tests.factories import synthetic_sentences

SETTINGS = DistillSettings(
    steps=30, max_seconds=300, lr=3e-3, temperature=2.0, alpha=0.5, batch_size=2, checkpoint_every=5, seed=7
)


class Interrupted(Exception):
    """Stands in for a crash or Ctrl-C in the middle of a run."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def teacher(tiny_model_dir: Path) -> LlamaForCausalLM:
    """The tiny model's architecture with 4 layers (so dropping some leaves a student) and sharper random logits.

    With the default 0.02 initialisation a random teacher predicts a near-uniform distribution that any student
    matches from the first step; 0.1 gives the KL term something to learn.
    """
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 4
    config.initializer_range = 0.1
    torch.manual_seed(3)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sequences(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tokenizer(text)["input_ids"] for text in synthetic_sentences(12, seed=11)]


def test_student_keeps_every_kth_layer_and_the_last_then_reloads_and_generates(teacher, sequences, tmp_path):
    student = build_student(teacher, keep_every=2)
    kept = [0, 2, 3]  # every second layer, plus the last
    assert student.config.num_hidden_layers == len(student.model.layers) == len(kept)
    assert teacher.config.num_hidden_layers == len(teacher.model.layers) == 4
    for layer, source in zip(student.model.layers, kept, strict=True):
        assert torch.equal(layer.mlp.up_proj.weight, teacher.model.layers[source].mlp.up_proj.weight)
        assert layer.mlp.up_proj.weight is not teacher.model.layers[source].mlp.up_proj.weight
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1, 2]
    assert build_student(teacher, keep_every=3).config.num_hidden_layers == 2  # 0 and 3
    assert build_student(teacher, keep_every=1).config.num_hidden_layers == 4
    student.save_pretrained(tmp_path / "student")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "student").eval()
    ids = torch.tensor([sequences[0]])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, student.eval()(input_ids=ids).logits)
    cached = reloaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    assert cached.shape == (1, ids.shape[1] + 6)
    assert torch.equal(cached, reloaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False))


def test_student_layers_can_be_a_count_spread_evenly_from_first_to_last():
    assert student_layers(30, layers=20)[:4] == [0, 2, 3, 5] and len(student_layers(30, layers=20)) == 20
    assert student_layers(30, layers=20)[-1] == 29 and student_layers(4, layers=2) == [0, 3]
    with pytest.raises(ValueError, match="layers: must be between 2 and the teacher's 4"):
        student_layers(4, layers=5)


def test_student_refuses_a_non_positive_keep_every(teacher):
    with pytest.raises(ValueError, match="keep_every"):
        build_student(teacher, keep_every=0)


def test_distillation_loss_decreases_and_every_step_is_reported(teacher, sequences, tmp_path):
    student = build_student(teacher, keep_every=2)
    reported = []
    result = distill(
        teacher, student, sequences, SETTINGS, tmp_path, lambda s, loss: reported.append((s, loss))
    )
    assert (result.step, result.resumed_from, result.stopped_by) == (30, 0, "steps")
    assert [step for step, _ in reported] == list(range(1, 31))
    assert [losses for _, losses in reported] == result.history
    first, last = result.history[:5], result.history[-5:]
    for key in ("loss", "ce"):  # at alpha 0.5 the hard labels dominate: KL to a random teacher may rise
        assert sum(h[key] for h in last) < 0.8 * sum(h[key] for h in first)
    final = last[-1]
    blended = SETTINGS.alpha * SETTINGS.temperature**2 * final["kl"] + (1 - SETTINGS.alpha) * final["ce"]
    assert final["loss"] == pytest.approx(blended, rel=1e-5)
    assert not student.training


def test_pure_distillation_pulls_the_student_towards_the_teacher(teacher, sequences, tmp_path):
    settings = replace(SETTINGS, alpha=1.0, steps=20)
    result = distill(teacher, build_student(teacher, keep_every=2), sequences, settings, tmp_path, None)
    kl = [h["kl"] for h in result.history]
    assert sum(kl[-5:]) < 0.6 * sum(kl[:5])
    assert result.history[-1]["loss"] == pytest.approx(settings.temperature**2 * kl[-1], rel=1e-5)


def test_interrupted_then_resumed_distillation_equals_an_uninterrupted_run(teacher, sequences, tmp_path):
    settings = replace(SETTINGS, steps=8, checkpoint_every=3)
    straight = build_student(teacher, keep_every=2)
    expected = distill(teacher, straight, sequences, settings, tmp_path / "straight", None)

    def crash_at_step_7(step: int, losses: dict[str, float]) -> None:
        if step == 7:
            raise Interrupted

    crashed = build_student(teacher, keep_every=2)
    with pytest.raises(Interrupted):
        distill(teacher, crashed, sequences, settings, tmp_path / "resumed", crash_at_step_7)
    resumed_student = build_student(teacher, keep_every=2)
    resumed = distill(teacher, resumed_student, sequences, settings, tmp_path / "resumed", None)
    assert resumed.resumed_from == 6  # the last checkpoint before the crash
    assert resumed.step == len(resumed.history) == 8
    for key in ("loss", "kl", "ce"):
        assert [h[key] for h in resumed.history] == pytest.approx(
            [h[key] for h in expected.history], rel=1e-6
        )
    for name, weight in straight.state_dict().items():
        torch.testing.assert_close(resumed_student.state_dict()[name], weight, atol=1e-6, rtol=0)
    assert not (tmp_path / "resumed" / (CHECKPOINT_FILE + ".partial")).exists()


def test_distillation_refuses_a_checkpoint_written_with_other_settings(teacher, sequences, tmp_path):
    settings = replace(SETTINGS, steps=2)
    distill(teacher, build_student(teacher, keep_every=2), sequences, settings, tmp_path, None)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        distill(
            teacher,
            build_student(teacher, keep_every=2),
            sequences,
            replace(settings, lr=1e-4),
            tmp_path,
            None,
        )


def test_distillation_stops_at_max_seconds_and_checkpoints_where_it_stopped(teacher, sequences, tmp_path):
    settings = replace(SETTINGS, steps=100_000, max_seconds=1.0)
    started = time.monotonic()
    result = distill(teacher, build_student(teacher, keep_every=2), sequences, settings, tmp_path, None)
    assert result.stopped_by == "max_seconds"
    assert 1 <= result.step < settings.steps
    assert len(result.history) == result.step
    assert torch.load(result.checkpoint, weights_only=True)["step"] == result.step
    assert time.monotonic() - started < 30  # generous: one step of a tiny model takes well under a second


@pytest.fixture(scope="module")
def teacher_base(teacher, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> PreparedBase:
    """The 4-layer teacher as the pipeline's load stage hands a base model over."""
    folder = tmp_path_factory.mktemp("teacher")
    teacher.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return PreparedBase(folder, folder_sha256(folder), "teacher")


DISTILL_STEP = {  # a tiny training budget: the export, not the training, is under test
    "distill": {"keep_every": 2, "steps": 4, "batch_size": 2, "sequence_tokens": 32, "checkpoint_every": 2}
}


def test_distill_then_onnx_genai_exports_the_smaller_student_that_scores_like_its_torch_twin(
    teacher_base, tmp_path
):
    """The graph has the student's 3 layers, not the teacher's 4, and its scores are the distilled torch
    student's to float rounding (far from the teacher's)."""
    import onnx

    recipes = {
        "teacher": [],
        "student": [DISTILL_STEP],
        "onnx": [DISTILL_STEP, {"onnx_genai": {"precision": "fp32"}}],
    }
    calibration = [" ".join(synthetic_sentences(20, seed=s)) for s in range(4)]
    manifests = {
        name: build_variant(
            name,
            VariantConfig.model_validate({"steps": steps}),
            teacher_base,
            "d",
            tmp_path / name,
            calibration,
        )
        for name, steps in recipes.items()
    }
    runtimes = {name: load_runtime(tmp_path / name, TargetConfig(threads=1)) for name in recipes}
    assert runtimes["onnx"].manifest.engine == "onnxruntime-genai"
    decoder = json.loads((tmp_path / "onnx" / "genai_config.json").read_text())["model"]["decoder"]
    graph = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False).graph
    caches = [
        i.name for i in graph.input if i.name.startswith("past_key_values.") and i.name.endswith(".key")
    ]
    assert (
        decoder["num_hidden_layers"] == len(caches) == runtimes["student"].model.config.num_hidden_layers == 3
    )
    assert manifests["onnx"].parameters == manifests["student"].parameters < manifests["teacher"].parameters
    assert len(manifests["onnx"].training["distill_loss"]) == 4
    ids = runtimes["student"].encode("The river walks the stone near the garden")
    nll = {name: runtime.score([ids])[0][0] for name, runtime in runtimes.items()}
    # a float32 ONNX graph (float32 MatMul, no MatMulNBits) against torch in float32: summation order only
    assert nll["onnx"] == pytest.approx(nll["student"], rel=1e-4)
    assert abs(nll["student"] - nll["teacher"]) > 0.01 * nll["teacher"]

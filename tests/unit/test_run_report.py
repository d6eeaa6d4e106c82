"""The run report and the flat MLflow params: what a reader of a run needs, in words and comparable columns."""

from dataclasses import replace

from tasks.config import SelectConfig
from tasks.decide.gate import Verdict
from tasks.decide.select import build_leaderboard
from tasks.engines.manifest import VariantManifest
from tasks.report.run_report import ReportContext, to_html, to_markdown
from tasks.report.tracking import recipe_params
from tests.unit.test_select import score


def board_and_context(promoted: bool):
    scores = [score("baseline", 1.0, 10), score("int8", 1.01, 40), score("bf16", 1.0, 8)]
    scores[1] = replace(scores[1], batch_decode_tok_s=((1, 40.0), (8, 200.0)))
    board = build_leaderboard(scores, SelectConfig(max_ppl_increase=0.05))
    evidence = {
        "objective": "latency",
        "speed_ratio": 1.31,
        "speed_ratio_ci": [1.12, 1.50],
        "speed_threshold": 1.05,
        "confidence": 0.95,
        "ppl_ratio_vs_champion": 1.002,
        "ppl_ratio_vs_champion_ci": [0.999, 1.004],
        "cloze_delta_vs_champion": 0.0,
        "cloze_p_vs_champion": 1.0,
    }
    verdict = Verdict(promoted, "int8 beats production v1: latency ×1.31", "int8", "1", evidence)
    context = ReportContext(
        "demo",
        "2026-11-30T12:00:00+00:00",
        ("1", "bf16"),
        verdict,
        promoted,
        "2",
        {"hash": "abc"},
        "build 3 s (total 9 s)",
        [],
    )
    return board, context


def test_the_report_compares_baseline_production_and_challenger_and_explains_the_decision():
    board, context = board_and_context(promoted=True)
    markdown = to_markdown(board, context)
    header = next(line for line in markdown.splitlines() if line.startswith("| measure"))
    assert header == "| measure | baseline (baseline) | production v1 (bf16) | challenger (int8) |"
    assert "Production moved to v2: int8 beats" in markdown and "interval 1.12–1.50" in markdown
    assert "| throughput tok/s, batch 8 | — | — | 200.0 |" in markdown
    assert (
        "No speedup on this machine: bf16" in markdown
    )  # an honest line for a technique that did not pay off
    page = to_html(board, context)
    assert page.startswith("<!doctype html>") and 'class="passed"' in page and "build 3 s" in page


def test_a_refusal_reads_as_production_unchanged():
    board, context = board_and_context(promoted=False)
    assert "Production unchanged: int8 beats" in to_markdown(board, context)
    assert 'class="refused"' in to_html(board, context)


def test_recipe_params_are_flat_and_carry_the_weight_precision():
    manifest = VariantManifest(
        "onnx_int4",
        {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32}}]},
        "r",
        "k",
        "b",
        "d",
        "onnx-genai",
        "float32",
        "onnxruntime-genai",
        1,
        1,
        "c",
    )
    params = recipe_params(manifest)
    assert params["technique"] == "onnx_genai" and params["weight_bits"] == 4
    assert params["onnx_genai.block_size"] == 32 and params["runtime.dtype"] == "float32"
    gptq = replace(manifest, recipe={"steps": [{"quantize": {"method": "gptqmodel", "bits": 3}}]})
    assert recipe_params(gptq)["weight_bits"] == 3 and recipe_params(gptq)["quantize.method"] == "gptqmodel"
    plain = replace(manifest, recipe={"runtime": {"dtype": "bfloat16"}}, dtype="bfloat16")
    assert recipe_params(plain)["technique"] == "runtime" and recipe_params(plain)["weight_bits"] == 16

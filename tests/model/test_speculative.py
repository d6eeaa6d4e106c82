"""Speculative decoding in every engine, on the tiny trained model: greedy output equals plain decoding where the
engine's k-token verify computes what its one-token decode computes, for prompts where the proposer is often right
and often wrong; long generations stay right token for token (the cache is rewound correctly); a speculative
variant is built from its plain twin's bytes (and its draft's), loads with its proposer, and is measured both ways.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.config import SpeculativeSettings, TargetConfig
from tasks.decide.select import Leaderboard, LeaderboardRow, VariantScore
from tasks.engines import load_runtime
from tasks.engines.speculative import DRAFT_FOLDER, Speculation
from tasks.measure.speculation import measure_speculation
from tasks.params import Config, VariantConfig
from tasks.techniques.build import build_variant
from tests.factories import synthetic_sentences

REPEATING = " ".join(synthetic_sentences(3, seed=5) * 3)  # lookup guesses right most of the time
FRESH = synthetic_sentences(1, seed=6)[0]  # ... and here mostly wrong
# engines whose verify of k tokens gives the logits of k one-token steps bit for bit (llama.cpp at any type)
EXACT = ["baseline", "onnx_fp32", "llama_q8_0", "llama_q4_0"]


def speculative_and_plain(runtime, settings: SpeculativeSettings, prompts, new_tokens):
    runtime.speculation = Speculation(settings)
    try:
        spoken = [runtime.generate([prompt], new_tokens, stop_at_eos=False)[0] for prompt in prompts]
        stats = runtime.speculation.stats
    finally:
        runtime.speculation = None
    plain = [runtime.generate([prompt], new_tokens, stop_at_eos=False)[0] for prompt in prompts]
    return spoken, plain, stats


@pytest.mark.parametrize("name", EXACT)
def test_greedy_speculation_gives_the_engines_own_greedy_tokens(trained_variants, name):
    runtime = load_runtime(trained_variants[name], TargetConfig(threads=1))
    prompts = [runtime.encode(REPEATING), runtime.encode(FRESH)]
    spoken, plain, stats = speculative_and_plain(
        runtime, SpeculativeSettings(method="ngram", tokens=4, ngram_size=2), prompts, 96
    )
    assert spoken == plain  # 96 tokens each: every rewind left the cache right
    assert 0 < stats.accepted < stats.proposed  # guesses were kept and refused


def test_a_draft_model_in_another_engine_proposes_and_the_target_decides(trained_variants):
    """The trained model's llama.cpp Q8_0 twin proposes for the fp32 torch model: it is mostly right, and the
    output is the fp32 model's."""
    target = load_runtime(trained_variants["baseline"], TargetConfig(threads=1))
    draft = load_runtime(trained_variants["llama_q8_0"], TargetConfig(threads=1))
    prompts = [target.encode(FRESH), target.encode(REPEATING)]
    settings = SpeculativeSettings(method="draft", tokens=4, draft="llama_q8_0")
    target.speculation = Speculation(settings, draft)
    spoken = [target.generate([prompt], 64, stop_at_eos=False)[0] for prompt in prompts]
    stats = target.speculation.stats
    target.speculation = None
    assert spoken == [target.generate([prompt], 64, stop_at_eos=False)[0] for prompt in prompts]
    assert stats.acceptance > 0.8 and stats.tokens_per_call > 3


def test_onnx_int4_verify_is_measured_not_assumed(trained_variants):
    """ONNX Runtime's int4 kernels differ between one new token and several: the benchmark's measurement reports
    how many tokens equal plain decoding's instead of assuming all do."""
    runtime = load_runtime(trained_variants["onnx_int4"], TargetConfig(threads=1))
    runtime.speculation = Speculation(SpeculativeSettings(method="ngram", tokens=3))
    styles = measure_speculation(runtime, runtime.encode(REPEATING), 48, 24, warmup=0, repeats=3)
    assert [s.style for s in styles] == ["continue", "copy"]
    for style in styles:
        assert 0 < style.agreement <= 1 and style.proposed > 0 and style.plain_tok_s > 0
    assert runtime.speculation.enabled and runtime.speculation.stats.proposed == 0  # left as found


def test_a_speculative_variant_links_its_twins_bytes_and_carries_its_draft(tiny_base, tmp_path):
    variants = tmp_path / "variants"
    recipes = Config.model_validate(
        {
            "variants": {
                "baseline": {},
                "llama": {"steps": [{"llama_cpp": {"type": "F32"}}]},
                "lookup": {"runtime": {"speculative": {"method": "ngram", "tokens": 3}}},
                "drafted": {"runtime": {"speculative": {"method": "draft", "draft": "llama"}}},
            }
        }
    ).variants
    for name in ("baseline", "llama"):
        build_variant(name, recipes[name], tiny_base, "d", variants / name)
    lookup = build_variant("lookup", recipes["lookup"], tiny_base, "d", variants / "lookup")
    drafted = build_variant(
        "drafted", recipes["drafted"], tiny_base, "d", variants / "drafted", draft=("llama", recipes["llama"])
    )
    weights = "model.safetensors"
    for name in ("lookup", "drafted"):  # the plain twin's bytes, linked
        assert os.path.samefile(variants / name / weights, variants / "baseline" / weights)
    assert os.path.samefile(
        variants / "drafted" / DRAFT_FOLDER / "model.gguf", variants / "llama" / "model.gguf"
    )
    assert lookup.content_hash != drafted.content_hash  # the draft's files are part of the variant
    assert "speculative decoding" in lookup.notes[-1] and "draft variant llama" in drafted.notes[-1]

    plain = load_runtime(variants / "baseline", TargetConfig(threads=1))
    prompt = plain.encode(REPEATING)
    expected = plain.generate([prompt], 40, stop_at_eos=False)[0]
    for name in ("lookup", "drafted"):
        runtime = load_runtime(variants / name, TargetConfig(threads=1))
        assert runtime.speculation is not None
        assert runtime.generate([prompt], 40, stop_at_eos=False)[0] == expected
        assert runtime.speculation.stats.calls > 0
    assert (
        load_runtime(variants / "drafted", TargetConfig(threads=1)).speculation.draft.manifest.engine
        == "llama.cpp"
    )
    # registered, it names the draft's engine among its requirements (a torch model with a llama.cpp draft)
    from tasks.decide.model_registry import model_requirements

    assert not any(
        r.startswith("llama-cpp-python==") for r in model_requirements(lookup, variants / "lookup")
    )
    assert any(r.startswith("llama-cpp-python==") for r in model_requirements(drafted, variants / "drafted"))
    # a changed draft recipe is another build
    other = VariantConfig.model_validate({"steps": [{"llama_cpp": {"type": "Q8_0"}}]})
    rebuilt = build_variant(
        "drafted", recipes["drafted"], tiny_base, "d", variants / "drafted", draft=("llama", other)
    )
    assert rebuilt.build_key != drafted.build_key


def test_the_leaderboard_shows_speculation_by_prompt_style(trained_variants):
    from dataclasses import replace

    runtime = load_runtime(trained_variants["baseline"], TargetConfig(threads=1))
    runtime.speculation = Speculation(SpeculativeSettings(method="ngram", tokens=2))
    styles = measure_speculation(runtime, runtime.encode(REPEATING), 32, 8, warmup=0, repeats=1)
    assert all(s.agreement == 1.0 for s in styles)  # torch on the CPU verifies exactly
    score = VariantScore(
        "lookup", 10.0, 1.0, 0.5, 10.0, 5.0, 1, 1.0, 1, (1.0,), (1,), (True,), speculation=tuple(styles)
    )
    row = LeaderboardRow(score, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, True)
    board = Leaderboard([row], "lookup", "lookup", 0.05, 0.95)
    text = board.to_markdown()
    assert "Speculative decoding" in text and "| lookup | copy (" in text and "| lookup | continue (" in text
    assert (
        replace(board, rows=[replace(row, score=replace(score, speculation=()))]).speculation_markdown() == ""
    )


def test_speculation_is_refused_where_it_cannot_run(tiny_base, tmp_path: Path):
    from tasks.errors import ConfigError

    with pytest.raises(ValueError, match="sliding_window"):
        VariantConfig.model_validate({"runtime": {"sliding_window": 64, "speculative": {"method": "ngram"}}})
    drafted = VariantConfig.model_validate(
        {"runtime": {"speculative": {"method": "draft", "draft": "small"}}}
    )
    with pytest.raises(ConfigError, match="its draft 'small' must be built with it"):
        build_variant("drafted", drafted, tiny_base, "d", tmp_path / "drafted")
    assert not (tmp_path / "drafted").exists()


def test_runs_to_length_bar_the_end_of_sequence_as_plain_decoding_does(trained_variants):
    """torch's `min_new_tokens` and ONNX Runtime GenAI's `min_length` bar the EOS ids when a benchmark runs to
    length; speculation bars the same ids (llama.cpp's plain loop bars none)."""
    for name, barred in (("baseline", True), ("onnx_fp32", True), ("llama_q8_0", False)):
        runtime = load_runtime(trained_variants[name], TargetConfig(threads=1))
        assert runtime.suppressed_at_length(True) == frozenset()
        assert (runtime.eos_token_id in runtime.suppressed_at_length(False)) is barred


def serve_alone(
    runtime, prompt: list[int], tokens: int, sampling=None, stop_ids=frozenset()
) -> tuple[list[int], list, int]:
    """One request through the server's scheduler: (its tokens, its last event, engine calls)."""
    import threading

    from serving.sampling import Sampling
    from serving.scheduler import GenerationRequest, Scheduler

    scheduler = Scheduler(runtime, max_batch=4, max_queue=4)
    out, events, done = [], [], threading.Event()

    def on_event(event):
        if event[0] == "token":
            out.append(event[1][0])
        elif event[0] in ("done", "error"):
            events.append(event)
            done.set()

    scheduler.submit(GenerationRequest(prompt, tokens, sampling or Sampling(), on_event, stop_ids))
    assert done.wait(120)
    scheduler.close()
    return out, events, scheduler.steps


@pytest.mark.parametrize("name", ["baseline", "llama_q8_0"])
def test_the_server_speculates_while_one_greedy_request_runs(trained_variants, name):
    from serving.sampling import Sampling

    runtime = load_runtime(trained_variants[name], TargetConfig(threads=1))
    prompt = runtime.encode(REPEATING)
    expected = runtime.generate([prompt], 48, stop_at_eos=False)[0]
    plain_tokens, _, plain_calls = serve_alone(runtime, prompt, 48)
    runtime.speculation = Speculation(SpeculativeSettings(method="ngram", tokens=4, ngram_size=2))
    tokens, events, calls = serve_alone(runtime, prompt, 48)
    assert tokens == plain_tokens == expected and events == [("done", "length")]
    assert runtime.speculation.stats.accepted > 0 and calls < plain_calls == 48
    stop = expected[30]  # a stop token met among kept guesses ends the request there
    tokens, events, _ = serve_alone(runtime, prompt, 48, stop_ids=frozenset({stop}))
    assert tokens == expected[: expected.index(stop) + 1] and events == [("done", "stop")]
    # a sampled request decodes plainly (the server applies the rejection rule to greedy requests only)
    before = runtime.speculation.stats.calls
    sampled, _, calls = serve_alone(runtime, prompt, 12, Sampling(temperature=1.0, seed=3))
    assert len(sampled) == 12 and calls == 12 and runtime.speculation.stats.calls == before

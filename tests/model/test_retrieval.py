"""The planted-fact check at long context: every engine answers each fact as a fresh greedy generation of the whole
window would (the haystack before a needle is shared by rewinding); a tiny model trained to copy finds the facts at
every depth, the same model with a cache that drops old positions (a sliding window) misses them, and the accuracy
budget of the document-QA profile refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import LongContextConfig, RetrievalConfig, TargetConfig
from tasks.decide.long_context import by_depth, long_context_failures, retrieval_scores
from tasks.decide.select import VariantScore, build_leaderboard
from tasks.engines import load_runtime
from tasks.errors import DataValidationError
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.measure import long_context, retrieval
from tasks.measure.evaluate import VariantEvaluation, evaluate_retrieval
from tasks.params import VariantConfig
from tasks.params_file import load_config
from tasks.techniques.build import build_variant
from tests.factories import TINY_ENGINE_RECIPES, filler_sentences, synthetic_sentences, train_tiny_copier

pytestmark = pytest.mark.numerics

PROFILE = Path(__file__).parents[2] / "params.document_qa.yaml"


@pytest.fixture(scope="module", params=sorted(TINY_ENGINE_RECIPES))
def runtime(request, tiny_engine_dir):
    return load_runtime(tiny_engine_dir(request.param), TargetConfig(threads=1))


def test_each_fact_is_answered_as_a_greedy_generation_of_its_whole_window(runtime, monkeypatch):
    monkeypatch.setattr(
        long_context, "SLICE_TOKENS", 37
    )  # the haystack in several calls, the last one partial
    cfg = LongContextConfig(
        documents=2, lengths=[200], tail_tokens=32, retrieval=RetrievalConfig(key_digits=3)
    )
    ids = runtime.encode(" ".join(synthetic_sentences(60, seed=4)))
    facts = retrieval.trials("doc", 200, cfg)
    answers = retrieval.answer_document(runtime, ids, 200, facts)  # one sequence, rewound between facts
    for fact, answer in zip(facts, answers, strict=True):
        before, after = retrieval.planted(runtime, ids, 200, fact)
        assert len(before) + len(after) + retrieval.answer_tokens(runtime, fact) == 200
        assert after[
            : len(runtime.encode(retrieval.NEEDLE.format(word=fact.word, key=fact.key)))
        ] == runtime.encode(retrieval.NEEDLE.format(word=fact.word, key=fact.key))
        count = retrieval.answer_tokens(runtime, fact)
        (alone,) = runtime.generate([before + after], count, stop_at_eos=False)
        assert answer == runtime.decode(alone)


def test_facts_are_seeded_per_document_and_length_and_read_strictly():
    cfg = LongContextConfig(documents=2, lengths=[128], tail_tokens=32)
    first, again = retrieval.trials("Ruth", 128, cfg), retrieval.trials("Ruth", 128, cfg)
    assert first == again and [f.depth for f in first] == [0.1, 0.5, 0.9]
    assert first != retrieval.trials("Ruth", 256, cfg) != retrieval.trials("Job", 128, cfg)
    assert all(len(f.key) == 5 and f.key[0] != "0" for f in first)
    assert retrieval.correct(" 48213.", "48213") and retrieval.correct("48213 is it", "48213")
    assert not retrieval.correct(" 482130", "48213") and not retrieval.correct(" 4821", "48213")
    assert not retrieval.correct(" the key", "48213")


def test_a_window_too_short_for_the_question_or_a_document_too_short_is_named(runtime):
    cfg = LongContextConfig(
        documents=2, lengths=[128], tail_tokens=32, retrieval=RetrievalConfig(lengths=[64, 128])
    )
    with pytest.raises(DataValidationError, match="64 tokens cannot hold the question"):
        retrieval.retrieval(runtime, [("doc", " ".join(synthetic_sentences(60, seed=1)))], cfg)
    with pytest.raises(DataValidationError, match="document 'psalm' has"):
        retrieval.retrieval(
            runtime, [("psalm", "O praise the LORD")], cfg.model_copy(update={"retrieval": RetrievalConfig()})
        )


@pytest.fixture(scope="module")
def copier(tmp_path_factory) -> dict[str, VariantEvaluation]:
    """The copier and its sliding-window twin (32 tokens: shorter than the question), their answers on four
    digit-free documents at two lengths."""
    root = tmp_path_factory.mktemp("copier")
    model = train_tiny_copier(root / "model")
    base = PreparedBase(model, folder_sha256(model), "copier")
    cfg = LongContextConfig(
        documents=4, lengths=[96, 128], tail_tokens=32, retrieval=RetrievalConfig(key_digits=1)
    )
    documents = [(f"doc{n}", " ".join(filler_sentences(80, seed=100 + n))) for n in range(4)]
    answers = {}
    for name, recipe in {"copier": {}, "window": {"runtime": {"sliding_window": 32}}}.items():
        build_variant(name, VariantConfig.model_validate(recipe), base, "d", root / name)
        answered = evaluate_retrieval(load_runtime(root / name, TargetConfig(threads=1)), (cfg, documents))
        answers[name] = VariantEvaluation(None, None, [], None, {}, {}, answered)
    return answers


def test_a_model_trained_to_copy_finds_every_planted_fact_and_a_forgetting_cache_misses_them(copier):
    found = retrieval_scores(copier["copier"])
    assert [length for length, *_ in found] == [96, 128]
    for score in found:
        assert all(accuracy >= 0.75 for accuracy in by_depth(score).values()), score
    assert sum(c for _, _, correct in found for c in correct) >= 22  # of 24
    missed = retrieval_scores(copier["window"])
    assert sum(c for _, _, correct in missed for c in correct) <= 12  # the fact is out of its window: guesses


def _score(name: str, evaluation: VariantEvaluation) -> VariantScore:
    """A leaderboard row equal to the baseline's in everything but the planted facts' answers."""
    return VariantScore(
        name,
        10.0,
        1.0,
        0.5,
        10.0,
        10.0,
        1000,
        1.0,
        10,
        (30.0,) * 16,
        (100,) * 16,
        (True, False) * 16,
        retrieval=retrieval_scores(evaluation),
    )


def test_the_document_qa_profile_refuses_the_forgetting_cache_and_keeps_the_copier(copier):
    select = load_config(PROFILE).select
    base, window = retrieval_scores(copier["copier"]), retrieval_scores(copier["window"])
    failures = long_context_failures((), window, base, select)
    assert len(failures) == 1 and failures[0].startswith("planted facts found")
    assert long_context_failures((), base, base, select) == []
    board = build_leaderboard(
        [_score(select.baseline, copier["copier"]), _score("window", copier["window"])],
        select.model_copy(update={"objective": "latency"}),
    )
    assert not board.row("window").qualifies and not board.row("window").within_budget
    assert "planted facts found" in "; ".join(board.row("window").failures)
    metrics = board.metrics()["window"]
    assert 0 <= metrics["retrieval_ctx128"] <= 0.5 and "retrieval_ctx96_depth0.1" in metrics
    assert "facts@128 (by depth %)" in board.to_markdown()

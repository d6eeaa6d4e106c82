"""Every engine keeps the written Runtime contract (tasks/engines/contract.py) on the same tiny model."""

from __future__ import annotations

import time

import pytest

from tasks.engines import ENGINES, Runtime, load_runtime
from tests.factories import TINY_ENGINE_RECIPES

TEXT = "The river walks the stone near the garden 12. The train finds the book near the quiet forest 7."
RECIPES = TINY_ENGINE_RECIPES  # the engines tiny_engine_dir builds


@pytest.fixture(scope="module", params=sorted(RECIPES))
def runtime(request, tiny_engine_dir) -> Runtime:
    return load_runtime(tiny_engine_dir(request.param), threads=1)


def test_every_registered_engine_is_covered_here():
    assert set(ENGINES) == set(RECIPES)


def test_encode_adds_no_bos_and_decode_skips_special_tokens(runtime):
    ids = runtime.encode(TEXT)
    assert ids[0] != runtime.bos_token_id and runtime.decode(ids) == TEXT
    assert runtime.decode([*ids, runtime.eos_token_id]) == TEXT


def test_score_predicts_every_token_but_the_first_from_its_own_sequence_only(runtime):
    ids = runtime.encode(TEXT)
    (alone,) = runtime.score([ids])
    together = runtime.score([ids[:5], ids, ids[:1]])
    assert together[1][0] == pytest.approx(alone[0], rel=1e-5) and together[1][1] == len(ids) - 1
    assert together[2] == (0.0, 0)  # a one-token sequence predicts nothing
    head, rest = runtime.score([ids[:5]])[0][0], alone[0]
    assert 0 < head < rest  # more predicted tokens, more total negative log-likelihood


def test_generate_keeps_order_batches_equal_lengths_and_stops_after_eos(runtime):
    ids = runtime.encode(TEXT)
    prompts = [ids[:7], ids[:12], ids[3:10]]
    fixed = runtime.generate(prompts, 6, stop_at_eos=False)
    assert [len(row) for row in fixed] == [6, 6, 6]
    assert fixed == [runtime.generate([prompt], 6, stop_at_eos=False)[0] for prompt in prompts]
    for row in runtime.generate(prompts, 6, stop_at_eos=True):
        assert len(row) <= 6 and (runtime.eos_token_id not in row[:-1])
    with pytest.raises(ValueError, match="empty prompt"):
        runtime.generate([ids[:3], []], 2)


def test_context_length_is_the_model_s(runtime, tiny_model_dir):
    import json

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert runtime.context_length == config["max_position_embeddings"]


def test_generate_reports_when_its_first_tokens_were_chosen(runtime):
    """`first_token_s`: set by every call, after the call began and long before a 64-token call ends (the prompt
    is short, so its first tokens take about one step of 64); the benchmark takes TTFT from it."""
    ids = runtime.encode(TEXT)[:8]
    runtime.generate([ids, ids], 2, stop_at_eos=False)  # warm
    for batch in ([ids], [ids, ids]):
        runtime.first_token_s = -1.0
        start = time.perf_counter()
        runtime.generate(batch, 64, stop_at_eos=False)
        elapsed = time.perf_counter() - start
        assert 0 < runtime.first_token_s < 0.5 * elapsed, (runtime.first_token_s, elapsed)

"""llmopt's own decode loop (tasks/engines/pytorch/decode_loop.py) on the CPU with a tiny random Llama at fp32: its
greedy tokens are `generate`'s, eager and through torch.compile; batch sizes share buckets, and a bucket already
made does not compile again.

What runs on a GPU is the step compiled by inductor with CUDA graphs; here the step is captured by dynamo as one
whole graph (`fullgraph=True`, so a graph break fails) and run by a counting backend: inductor's code generation on
2 cores would take minutes per graph, and what this test guards (the step's capture, its tokens, when it
recompiles) is dynamo's part. `make gpu-check` compiles the same step with inductor on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.pytorch.decode_loop import (
    STOP_CHECK_EVERY,
    DecodeLoop,
    batch_bucket,
    cache_bytes,
    length_bucket,
)
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30, 31, 32, 33, 34, 35, 36, 37]]
EOS = 2


@pytest.fixture(autouse=True)
def compile_budget(monkeypatch):
    """Each test with the process's compile budget whole (`may_compile` counts every test's graphs otherwise)."""
    from collections import Counter

    from tasks.engines.pytorch import decode_loop

    monkeypatch.setattr(decode_loop, "_compiled_graphs", Counter())


def tiny_llama(**config) -> LlamaForCausalLM:
    """A tiny random Llama (seeded), its logits peaked so greedy choices are far from ties; `config` overrides."""
    torch.manual_seed(0)
    shape = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    }
    model = LlamaForCausalLM(LlamaConfig(**{**shape, **config})).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def reference(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate`, end of sequence barred as a run to length bars it."""
    rows, length = len(prompts), len(prompts[0])
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(prompts),
            attention_mask=torch.ones(rows, length, dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    return out[:, length:].tolist()


class Counting:
    """A torch.compile backend that runs dynamo's graph as it is and counts the graphs it was given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph.forward

    def compiler(self, step):
        return torch.compile(step, backend=self, fullgraph=True, dynamic=False)


def test_buckets():
    assert [batch_bucket(rows) for rows in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert (
        length_bucket(160, 1024) == 256
        and length_bucket(256, 1024) == 256
        and length_bucket(257, 1024) == 512
    )
    assert length_bucket(900, 1000) == 1000  # the last bucket is the context
    with pytest.raises(ValueError, match="do not fit"):
        length_bucket(1001, 1000)
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_eager_loop_gives_generates_tokens_padded_rows_dropped(model):
    loop = DecodeLoop(model, torch.device("cpu"), None, torch.inference_mode)
    assert loop.generate(PROMPTS, 20, frozenset({EOS})) == reference(model, PROMPTS, 20)
    assert loop.generate(PROMPTS[1:2], 6, frozenset({EOS})) == reference(model, PROMPTS[1:2], 6)
    assert loop.buckets == [(1, 256), (4, 256)]  # three rows ran in the bucket of four


def test_compiled_step_gives_the_same_tokens_and_does_not_recompile_a_bucket_it_made(model):
    counting = Counting()
    loop = DecodeLoop(model, torch.device("cpu"), counting.compiler, torch.inference_mode)
    expected = reference(model, PROMPTS, 20)
    assert loop.generate(PROMPTS, 20, frozenset({EOS})) == expected  # bucket (4, 256)
    assert loop.generate(PROMPTS[:1], 20, frozenset({EOS})) == expected[:1]  # bucket (1, 256)
    made = counting.graphs
    assert made == 2
    # what a timed run then does: other batch sizes of those buckets, other lengths, other token counts
    assert loop.generate(PROMPTS[:2] + PROMPTS[:2], 9, frozenset({EOS})) == [r[:9] for r in expected[:2] * 2]
    assert loop.generate([p[:5] for p in PROMPTS], 3, frozenset({EOS})) == reference(
        model, [p[:5] for p in PROMPTS], 3
    )
    assert loop.generate(PROMPTS[2:], 1, frozenset({EOS})) == [expected[2][:1]]
    assert counting.graphs == made
    assert loop.buckets == [(1, 256), (4, 256)] and set(loop.compile_s) == set(loop.buckets)  # reported apart


def test_suppressed_ids_are_never_chosen(model):
    loop = DecodeLoop(model, torch.device("cpu"), None, torch.inference_mode)
    free = loop.generate(PROMPTS, 12)
    barred = frozenset(free[0][:3])
    out = loop.generate(PROMPTS, 12, barred)
    assert not barred & {token for row in out for token in row}
    assert out != free


def cut(row: list[int], stop: set[int]) -> list[int]:
    return next((row[: i + 1] for i, token in enumerate(row) if token in stop), row)


def test_each_row_ends_at_its_first_stop_id_and_the_call_once_every_row_has(model):
    """Any of several end-of-sequence ids ends a row (some models' generation configs list several, and `generate`
    stops at each); the call stops looking once every row has ended, at its next look."""
    loop = DecodeLoop(model, torch.device("cpu"), None, torch.inference_mode)
    length = 3 * STOP_CHECK_EVERY
    full, other = loop.generate(PROMPTS[:1], length)[0], loop.generate(PROMPTS[1:2], length)[0]
    firsts = []
    stopped = loop.generate(PROMPTS[:1], length, stop=frozenset({full[2]}), on_first=lambda: firsts.append(1))
    assert stopped == [cut(full, {full[2]})] and len(stopped[0]) <= 3
    assert firsts == [1]
    # a row that has not ended keeps the call going; it ends at its own id
    assert full[2] not in other
    assert loop.generate(PROMPTS[:2], length, stop=frozenset({full[2]})) == [cut(full, {full[2]}), other]
    both = frozenset({full[2], other[4]})
    assert loop.generate(PROMPTS[:2], length, stop=both) == [cut(full, both), cut(other, both)]


def test_suppressed_ids_past_the_vocabulary_are_ignored_and_zero_tokens_refused(model):
    loop = DecodeLoop(model, torch.device("cpu"), None, torch.inference_mode)
    assert loop.generate(PROMPTS[:1], 4, frozenset({10_000})) == loop.generate(PROMPTS[:1], 4)
    with pytest.raises(ValueError, match="at least one token"):
        loop.generate(PROMPTS[:1], 0)


def test_prompts_of_other_lengths_are_refused(model):
    loop = DecodeLoop(model, torch.device("cpu"), None, torch.inference_mode)
    with pytest.raises(ValueError, match="one length"):
        loop.generate([[1, 2, 3], [1, 2]], 4)


def test_the_runtime_generates_through_the_loop_under_its_inference_context(trained_base, tmp_path):
    """The loop as a cuda target's runtime holds it (`_loop`, made on cuda only), here on the CPU: its tokens are the
    runtime's own, call after call under the runtime's inference context (torch.inference_mode: the first GPU run
    failed at the second call, resetting the cache's inference tensors outside it), first tokens timed."""
    folder = tmp_path / "static"
    recipe = VariantConfig.model_validate({"runtime": {"kv_cache": "static"}})
    build_variant("static", recipe, trained_base, "d", folder)
    runtime = load_runtime(folder, TargetConfig(threads=1))
    ids = runtime.encode("the quick brown fox jumps over the lazy dog and runs far away")
    expected = runtime.generate([ids, ids[:-2]], 12, stop_at_eos=False)
    assert runtime._loop is None and runtime.compile_s is None  # a CPU target keeps transformers' generate
    runtime._loop = DecodeLoop(runtime.model, runtime.device, Counting().compiler, runtime._no_grad)
    for _ in range(2):
        assert runtime.generate([ids, ids[:-2]], 12, stop_at_eos=False) == expected
        assert runtime.first_token_s is not None
    assert runtime.compile_s > 0  # the one bucket's first step


def test_inductor_compiled_step_gives_the_eager_tokens(model):
    """The step through inductor itself (its default mode: CUDA graphs need a GPU), one bucket (~10 s here)."""
    loop = DecodeLoop(
        model,
        torch.device("cpu"),
        lambda step: torch.compile(step, fullgraph=True, dynamic=False),
        torch.inference_mode,
    )
    assert loop.generate(PROMPTS, 12, frozenset({EOS})) == reference(model, PROMPTS, 12)


def test_the_runtime_stops_the_loop_where_generate_stops(trained_base, tmp_path):
    """A generation config that lists several end-of-sequence ids: the loop ends a row at any of them, as
    transformers' `generate` does (the runtime passes every id it stops on), not only at the tokenizer's."""
    folder = tmp_path / "static"
    build_variant(
        "static", VariantConfig.model_validate({"runtime": {"kv_cache": "static"}}), trained_base, "d", folder
    )
    runtime = load_runtime(folder, TargetConfig(threads=1))
    ids = runtime.encode("the quick brown fox jumps over the lazy dog and runs far away")
    free = runtime.generate([ids], 12, stop_at_eos=False)[0]
    runtime.model.generation_config.eos_token_id = [runtime.eos_token_id, free[3]]
    expected, to_length = runtime.generate([ids], 12), runtime.generate([ids], 12, stop_at_eos=False)
    assert expected == [cut(free, {free[3], runtime.eos_token_id})] and free[3] not in to_length[0]
    runtime._loop = DecodeLoop(runtime.model, runtime.device, None, runtime._no_grad)
    assert runtime.generate([ids], 12) == expected
    assert runtime.generate([ids], 12, stop_at_eos=False) == to_length  # running to length bars them all


def test_buckets_the_device_cannot_hold_beside_a_new_one_are_dropped_least_recently_used_first(
    model, monkeypatch
):
    """A device of 5 units (a (1, 256) cache is one; a new cache may take 80 % of what is free): (1, 256) and
    (1, 512) fit, (1, 256) is used again, then (2, 256) needs 2 units of the 2 left: the least recently used,
    (1, 512), goes, not the older (1, 256). Every call's tokens stay `generate`'s."""
    from tasks.engines.pytorch import decode_loop

    unit = cache_bytes(model, (1, 256))
    loop = DecodeLoop(model, torch.device("cpu"), Counting().compiler, torch.inference_mode)
    held = lambda: sum(cache_bytes(model, bucket) for bucket in loop.buckets)  # noqa: E731
    monkeypatch.setattr(decode_loop, "device_free_bytes", lambda device: 5 * unit - held())
    long = [list(range(5, 265))]  # 260 tokens + 6: the bucket of 512 positions
    assert loop.generate(PROMPTS[:1], 6) == reference(model, PROMPTS[:1], 6)
    assert loop.generate(long, 6) == reference(model, long, 6)
    assert loop.buckets == [(1, 256), (1, 512)]
    assert loop.generate(PROMPTS[1:2], 6) == reference(model, PROMPTS[1:2], 6)  # (1, 256) used last
    assert loop.generate(PROMPTS[:2], 6) == reference(model, PROMPTS[:2], 6)
    assert loop.buckets == [(1, 256), (2, 256)]


def test_buckets_past_the_compile_limit_step_eagerly_with_the_same_tokens(model, monkeypatch, caplog):
    """After `MAX_COMPILED_BUCKETS` compiled graphs of the step in the process a new bucket steps eagerly (said once
    in the log), where dynamo's recompile limit would stop a fullgraph compile with an error half-way through an
    evaluation."""
    from tasks.engines.pytorch import decode_loop

    monkeypatch.setattr(decode_loop, "MAX_COMPILED_BUCKETS", 1)
    counting = Counting()
    loop = DecodeLoop(model, torch.device("cpu"), counting.compiler, torch.inference_mode)
    assert loop.generate(PROMPTS, 6) == reference(model, PROMPTS, 6)
    with caplog.at_level("WARNING", logger=decode_loop.__name__):
        assert loop.generate(PROMPTS[:1], 6) == reference(model, PROMPTS[:1], 6)
        assert loop.generate(PROMPTS[:2], 6) == reference(model, PROMPTS[:2], 6)
    assert counting.graphs == 1 and loop.buckets == [(1, 256), (2, 256), (4, 256)]
    said = [r.getMessage() for r in caplog.records if r.name == decode_loop.__name__]
    assert said == ["decode loop: 1 graphs compiled in this process; new buckets step eagerly"]

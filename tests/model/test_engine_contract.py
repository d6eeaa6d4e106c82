"""Every engine keeps the written Runtime contract (tasks/engines/contract.py) on the same tiny model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tasks.config import TargetConfig
from tasks.engines import ENGINES, Runtime, load_runtime
from tests.factories import TINY_ENGINE_RECIPES

TEXT = "The river walks the stone near the garden 12. The train finds the book near the quiet forest 7."
RECIPES = TINY_ENGINE_RECIPES  # the engines tiny_engine_dir builds


@pytest.fixture(scope="module", params=sorted(RECIPES))
def runtime(request, tiny_engine_dir) -> Runtime:
    return load_runtime(tiny_engine_dir(request.param), TargetConfig(threads=1))


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
    # the same sequence's float32 pass beside others: equal, or rounding apart where rows share a kernel call
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


def test_generate_reports_its_first_tokens_after_the_first_engine_step(runtime, monkeypatch):
    """`first_token_s` is set by every call, in the engine's loop right after its first step (prefill and the
    first pick) and before its second: the benchmark takes TTFT from it. Checked on the engine's own step count
    when the report is made, not on the clock (a wall-clock ratio depends on the CPU: on a fast one the tiny
    model's 64 steps take less than the fixed cost before the first token)."""
    steps: list[str] = []
    at_report: list[int] = []
    _count_engine_steps(runtime, steps, monkeypatch)
    report = runtime._first_tokens

    def reported() -> None:
        at_report.append(len(steps))
        report()

    monkeypatch.setattr(runtime, "_first_tokens", reported)
    ids = runtime.encode(TEXT)[:8]
    for batch in ([ids], [ids, ids]):
        steps.clear()
        at_report.clear()
        runtime.first_token_s = -1.0
        start = time.perf_counter()
        runtime.generate(batch, 64, stop_at_eos=False)
        elapsed = time.perf_counter() - start
        assert at_report[:1] == [1] and len(steps) == 64, (at_report, len(steps))
        assert 0 < runtime.first_token_s <= elapsed


def _count_engine_steps(runtime: Runtime, steps: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Append to `steps` at each call of the engine primitive that runs the model and picks next tokens."""
    engine = runtime.manifest.engine
    if engine == "torch":
        monkeypatch.setattr(runtime.model, "forward", _Counted(runtime.model, "forward", steps).forward)
    elif engine == "onnxruntime-genai":
        generator = runtime._generator
        monkeypatch.setattr(
            runtime, "_generator", lambda *a, **k: _Counted(generator(*a, **k), "generate_next_token", steps)
        )
    elif engine == "llama.cpp":
        context = runtime.context
        monkeypatch.setattr(runtime, "context", lambda *a, **k: _Counted(context(*a, **k), "decode", steps))
    else:
        raise AssertionError(f"no step counter for engine {engine!r}: add one here")


class _Counted:
    """`inner` with every call of its method `name` appended to `steps`."""

    def __init__(self, inner: object, name: str, steps: list[str]) -> None:
        self._inner, self._name, self._steps = inner, name, steps

    def __getattr__(self, attribute: str):
        value = getattr(self._inner, attribute)
        if attribute != self._name:
            return value

        def counted(*args, **kwargs):
            self._steps.append(attribute)
            return value(*args, **kwargs)

        return counted


def test_stepping_gives_each_sequence_its_own_logits_while_others_join_and_leave(runtime):
    """Greedy stepping through `batch_decoder`: each sequence gets the logits it gets stepped alone (to float32
    rounding) and the tokens `generate` gives it, while others join after it and leave before it (a row in the
    middle leaving, then a newcomer joining)."""
    ids = runtime.encode(TEXT)
    wanted = {"a": (ids[:9], 10), "b": (ids[2:7], 3), "c": (ids[4:16], 8), "d": (ids[1:12], 6)}
    together = _stepped(runtime, wanted, joins={0: "abc", 3: "d"})
    for name, (prompt, count) in wanted.items():
        alone = _stepped(runtime, {name: (prompt, count)}, joins={0: name})[name]
        # rounding apart at most: llama.cpp's batched kernels sum in another order than one row's, into a float16
        # cache (1.8e-4 measured); a row reading another sequence's cache is ~0.1 off
        np.testing.assert_allclose(np.stack(together[name]), np.stack(alone), atol=2e-3, err_msg=name)
        tokens = [int(np.argmax(row)) for row in together[name]]
        assert tokens == runtime.generate([prompt], count, stop_at_eos=False)[0], name


def _stepped(runtime: Runtime, wanted: dict, joins: dict[int, str]) -> dict[str, list]:
    """Step `wanted` (name: (prompt, tokens)) greedily through one decoder, each joining at the step `joins`
    names and leaving once it has its tokens; each one's logits, in order."""
    decoder, sequences = runtime.batch_decoder(), {}
    logits: dict[str, list] = {name: [] for name in wanted}
    for step in range(max(n for _, n in wanted.values()) + max(joins)):
        for sequence, name in list(sequences.items()):
            if len(logits[name]) == wanted[name][1]:
                decoder.remove(sequence)
                del sequences[sequence]
        tokens = {s: int(np.argmax(logits[name][-1])) for s, name in sequences.items()}
        stepped = decoder.step(tokens) if tokens else {}
        for sequence, row in stepped.items():
            logits[sequences[sequence]].append(np.asarray(row, dtype=np.float32))
        for name in joins.get(step, ""):
            sequence, row = decoder.add(wanted[name][0])
            sequences[sequence] = name
            logits[name].append(np.asarray(row, dtype=np.float32))
    for sequence in sequences:
        decoder.remove(sequence)
    assert decoder.active == 0 and all(len(logits[name]) == n for name, (_, n) in wanted.items())
    return logits

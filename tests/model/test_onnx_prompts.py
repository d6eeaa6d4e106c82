"""The ONNX decoder runs long prompt slices with float activations where the graph rounds them to int8 (its
MatMulNBits at accuracy level 4), or in bfloat16 by torch on the graph's own weights where that pays
(tasks/engines/onnx/bf16_prompts.py), and steps and short slices as the graph says (tasks/engines/onnx/batch.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.onnx import bf16_prompts, float_prompts
from tasks.engines.onnx.batch import (
    BF16_PROMPT_TOKENS,
    BF16_SLICE_TOKENS,
    FLOAT_PROMPT_TOKENS,
    RESERVED_POSITIONS,
    OrtBatchDecoder,
)
from tasks.engines.onnx.bf16_prompts import AGREEMENT, BfloatPrompts, faster_in_bf16
from tasks.engines.onnx.graph_weights import GraphWeights
from tasks.inputs.load import PreparedBase
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant

INT4 = {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32}}]}  # accuracy level 4: the default
# the production's shape: 8-bit MatMulNBits beside 4-bit ones, the embedding lookup on the int8 lm_head's table
HEAD8 = {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32, "lm_head": "int8"}}]}


@pytest.fixture(scope="module")
def int4_runtime(trained_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("onnx-int4") / "onnx_int4"
    build_variant("onnx_int4", VariantConfig.model_validate(INT4), trained_base, "d", folder)
    return load_runtime(folder, TargetConfig(threads=1))


@pytest.fixture(scope="module")
def head8_runtime(trained_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("onnx-head8") / "onnx_int4_head8"
    build_variant("onnx_int4_head8", VariantConfig.model_validate(HEAD8), trained_base, "d", folder)
    return load_runtime(folder, TargetConfig(threads=1))


def decoder_of(runtime, bf16: BfloatPrompts | None = None) -> OrtBatchDecoder:
    """A batch decoder of `runtime`'s graph with the prompt path given (the float session where None), not the
    one `batch_decoder` would choose by timing both on this machine."""
    import json

    config = json.loads((Path(runtime._folder) / "genai_config.json").read_text())["model"]["decoder"]
    shape = (config["num_key_value_heads"], config["head_size"])
    return OrtBatchDecoder(Path(runtime._folder) / "model.onnx", shape, 1, bf16=bf16)


def sessions_used(decoder: OrtBatchDecoder) -> list[str]:
    """Which session each call of `decoder` runs on, in order ("float" or "graph")."""
    calls: list[str] = []
    for name, session in (("float", decoder._prompt_session), ("graph", decoder._session)):

        class Spy:
            def __init__(self, inner, label=name):
                self._inner, self._label = inner, label

            def run(self, *args, **kwargs):
                calls.append(self._label)
                return self._inner.run(*args, **kwargs)

            def run_with_iobinding(self, *args, **kwargs):
                calls.append(self._label)
                return self._inner.run_with_iobinding(*args, **kwargs)

            def __getattr__(self, attribute):
                return getattr(self._inner, attribute)

        if name == "float":
            decoder._prompt_session = Spy(session)
        else:
            decoder._session = Spy(session)
    return calls


def test_long_slices_run_with_float_activations_steps_and_short_slices_as_the_graph_says(int4_runtime):
    import onnx

    decoder = decoder_of(int4_runtime)
    model = Path(int4_runtime._folder) / "model.onnx"
    assert float_prompts.rounds_activations_to_int8(onnx.load(model, load_external_data=False))
    assert decoder._prompt_session is not decoder._session  # a second session, float activations
    option = "mlas.qnbit.force_fp32"
    assert decoder._prompt_session.get_session_options().get_session_config_entry(option) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # the graph's own: as built
        decoder._session.get_session_options().get_session_config_entry(option)
    calls = sessions_used(decoder)
    prompt = [(7 * index) % 200 + 3 for index in range(FLOAT_PROMPT_TOKENS + 9)]
    sequence, _ = decoder.add(prompt)  # one slice of more than FLOAT_PROMPT_TOKENS tokens
    short, _ = decoder.add(prompt[: FLOAT_PROMPT_TOKENS - 1])
    decoder.step({sequence: 5, short: 6})
    assert calls == ["float", "graph", "graph"]


def test_float_activations_run_prompts_only_from_the_length_where_they_pay_on_this_cpu(
    int4_runtime, monkeypatch
):
    now = [0.0]  # the probe's clock, moved by the calls it times: the verdict does not hang on this machine
    monkeypatch.setattr(float_prompts, "clock", lambda: now[0])

    def timed(decoder, seconds):  # each call costs seconds(tokens, float activations)
        run = decoder._run_alone

        def run_alone(chunk, cache, long=True):
            now[0] += seconds(len(chunk), long)
            return run(chunk, cache, long)

        decoder._run_alone = run_alone
        return run

    def prompt(length, seed):  # prompts that share no start (no prefix reuse between them)
        return [(seed + 13 * index) % 200 + 3 for index in range(length)]

    decoder = decoder_of(int4_runtime)
    run = timed(decoder, lambda tokens, long: tokens * 1e-3 * (0.8 if long and tokens >= 64 else 1.0))
    assert decoder.choose_float_from(context=2048) == 64  # faster at 128, 96 and 64, as long at 48: from 64
    decoder._run_alone = run
    calls = sessions_used(decoder)
    decoder.add(prompt(64, 1))
    decoder.add(prompt(63, 2))
    assert calls == ["float", "graph"]

    # from the longest down: faster at 128, not at 96, faster again at 64 and below: from 128 only
    gap = decoder_of(int4_runtime)
    timed(gap, lambda tokens, long: tokens * 1e-3 * (0.8 if long and tokens != 96 else 1.0))
    assert gap.choose_float_from(context=2048) == 128
    # the bfloat16 probe (96 tokens) is timed against what such a slice runs on now: the graph
    del gap._run_alone  # (untimed again)
    calls = sessions_used(gap)

    def probe(path, names, kv_shape, threads, run):
        run(prompt(96, 4), gap._empty_cache())

    monkeypatch.setattr("tasks.engines.onnx.batch.faster_in_bf16", probe)
    assert gap.choose_bf16() is None and calls == ["graph"]
    monkeypatch.setattr("tasks.engines.onnx.batch.faster_in_bf16", faster_in_bf16)
    # a model too quick to time (under QUICKEST_SECONDS) keeps the default
    quick = decoder_of(int4_runtime)
    timed(quick, lambda tokens, long: tokens * 1e-5 * (1.0 if long else 0.5))
    assert quick.choose_float_from(context=2048) == FLOAT_PROMPT_TOKENS
    # a large model's calls take seconds: no shorter length is probed once PROBE_SECONDS are spent
    slow = decoder_of(int4_runtime)
    timed(slow, lambda tokens, long: tokens * 0.01 * (0.8 if long else 1.0))  # both 128-token calls: 2.3 s
    assert slow.choose_float_from(context=2048) == 96
    # no slice longer than the model's context is probed: here it pays only beyond it
    short = decoder_of(int4_runtime)
    timed(short, lambda tokens, long: tokens * 1e-3 * (0.8 if long and tokens > 100 else 1.0))
    assert short.choose_float_from(context=100) is None

    nowhere = decoder_of(int4_runtime)  # as on an AVX2 CPU: as long, or longer, at every length
    timed(nowhere, lambda tokens, long: tokens * 1e-3 * (0.97 if long else 1.0))
    assert nowhere.choose_float_from(context=2048) is None
    assert nowhere._prompt_session is nowhere._session  # the second copy of the weights dropped
    calls = sessions_used(nowhere)
    nowhere.add(prompt(130, 3))
    assert calls == ["graph"]

    def failing(tokens, long):
        raise RuntimeError("planted: ONNX Runtime failed")

    broken = decoder_of(int4_runtime)  # a probe that fails leaves the graph serving, no error
    broken._run_alone = lambda chunk, cache, long=True: failing(chunk, long)
    assert broken.choose_float_from(context=2048) is None
    assert broken._prompt_session is broken._session

    # the runtime decides once, and its later decoders run float activations from the length it chose
    chosen = load_runtime(Path(int4_runtime._folder), TargetConfig(threads=1))
    monkeypatch.setattr("tasks.engines.onnx.batch.measured_float_from", lambda *args: 64)
    first = chosen.batch_decoder()
    monkeypatch.setattr(
        "tasks.engines.onnx.batch.measured_float_from", lambda *args: pytest.fail("decided twice")
    )
    second = chosen.batch_decoder()
    assert first._float_from == second._float_from == 64
    assert second._prompt_session is not second._session


def test_a_float_prompt_gives_the_graphs_logits_to_int8_rounding_and_the_same_answer(int4_runtime):
    """The two paths differ only in how activations are rounded: the float one's last-position logits stay within
    a few hundredths of the logits' spread of the graph's own, and greedy decoding after either prompt agrees."""
    prompt = [(11 * index) % 250 + 3 for index in range(3 * FLOAT_PROMPT_TOKENS)]
    float_path = decoder_of(int4_runtime)
    graph_path = decoder_of(int4_runtime)
    graph_path._prompt_session = graph_path._session  # this one runs the prompt as the graph says
    answers = []
    for decoder in (float_path, graph_path):
        sequence, logits = decoder.add(prompt)
        tokens = [int(np.argmax(logits))]
        for _ in range(12):
            tokens.append(int(np.argmax(decoder.step({sequence: tokens[-1]})[sequence])))
        answers.append((logits, tokens))
    (float_logits, float_tokens), (graph_logits, graph_tokens) = answers
    spread = float(graph_logits.max() - graph_logits.min())
    differ = float(np.abs(float_logits - graph_logits).max())
    # measured 0.6 % here (AVX-512 VNNI); a CPU without MLAS's int8 kernels would compute both alike (0)
    assert differ <= 0.05 * spread, (differ, spread)
    assert float_tokens == graph_tokens


def test_a_graph_with_float_activations_keeps_one_session(tiny_engine_dir):
    """The fp32 export has no MatMulNBits: nothing to run differently, no second copy of the weights."""
    decoder = load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1)).batch_decoder()
    assert decoder._prompt_session is decoder._session


def graph_weights(runtime) -> GraphWeights:
    weights = GraphWeights.read(Path(runtime._folder) / "model.onnx")
    assert weights is not None  # the builder's int4 graph is one the path reads
    return weights


def empty_cache(decoder: OrtBatchDecoder) -> list[np.ndarray]:
    return [np.zeros((1, *decoder._kv_shape[:1], 0, decoder._kv_shape[1]), np.float32) for _ in decoder._past]


@pytest.mark.parametrize("graph", ["int4", "int4 with an int8 lm_head"])
def test_the_graph_read_back_in_float32_computes_what_the_float_session_computes(
    graph, int4_runtime, head8_runtime
):
    """The reader gets every weight, norm, rotary table and the attention's layout right: in float32 its logits and
    keys/values match ONNX Runtime's float session of the same graph to float rounding, for a prompt from position 0
    and for a slice after a cache (positions and the causal mask after what the row holds); 4-bit matrices, and an
    8-bit lm_head whose table the embedding lookup shares (the production's shape). Where the graph's 8-bit matrices
    round activations even in the float session, to the float session's int8 rounding instead."""
    import torch

    runtime = int4_runtime if graph == "int4" else head8_runtime
    decoder = decoder_of(runtime)
    exact = BfloatPrompts(graph_weights(runtime), decoder._past, torch.float32)
    prompt = [(13 * index) % 250 + 3 for index in range(70)]
    cache = empty_cache(decoder)
    # the float session's 8-bit lm_head still quantizes its input (MLAS has no float path for 8 bits); the layers'
    # keys and values come before it, exact
    tolerance = 1e-3 if graph == "int4" else AGREEMENT
    for chunk in (prompt[:40], prompt[40:]):
        ((ours, ours_cache),) = exact.run([(cache, chunk)])
        theirs, theirs_cache = decoder._run_alone(chunk, cache, long=True)
        spread = float(theirs.max() - theirs.min())
        assert float(np.abs(ours - theirs).max()) <= tolerance * spread
        for mine, kept in zip(ours_cache, theirs_cache, strict=True):
            assert mine.shape == kept.shape
            assert float(np.abs(mine - kept).max()) <= 1e-3 * float(np.abs(kept).max())
        cache = theirs_cache


def test_long_slices_of_a_step_run_in_one_bf16_call_and_the_graph_decodes_after_them(int4_runtime):
    """Two prompts' long slices run in one bfloat16 call (a short one of the same step with them), their keys and
    values join the graph's cache, and decoding goes on there: after the prompts and for the steps after them,
    logits within AGREEMENT of their spread of the decoder without the path (a cache handed over at wrong positions
    or rotations, or not at all, is far outside that). Greedy answers can part at a near-tie (the bfloat16 prompt
    is another rounding of the same computation), as they can between the float session and the graph."""
    weights = graph_weights(int4_runtime)
    plain = decoder_of(int4_runtime)
    with_bf16 = decoder_of(int4_runtime, BfloatPrompts(weights, plain._past))
    assert (
        with_bf16._prompt_session is not with_bf16._session
    )  # a lone long slice still runs on the float one
    calls: list[list[int]] = []
    run = with_bf16._bf16.run
    with_bf16._bf16.run = lambda slices: calls.append([len(t) for _, t in slices]) or run(slices)
    width = max(BF16_SLICE_TOKENS, BF16_PROMPT_TOKENS // 2)
    prompts = [[(k * index) % 240 + 5 for index in range(2 * width)] for k in (7, 11)]
    short = [9, 8, 7]
    answers = []
    for decoder in (with_bf16, plain):
        first, second, third = (decoder.open([])[0] for _ in range(3))
        one, two = prompts
        fills = [(first, one[:width], False), (second, two[:width], False), (third, short, True)]
        _, filled = decoder.step_with_prefills({}, fills)
        tokens = {third: [int(np.argmax(filled[third]))]}
        short_logits = filled[third]
        fills = [(first, one[width:], True), (second, two[width:], True)]
        stepped, filled = decoder.step_with_prefills({third: tokens[third][0]}, fills)
        tokens[third].append(int(np.argmax(stepped[third])))
        tokens.update({s: [int(np.argmax(filled[s]))] for s in (first, second)})
        logits = [short_logits, filled[first], filled[second]]
        for _ in range(3):  # the same tokens into both decoders: the first one's picks
            picks = answers[0][1] if answers else None
            stepped = decoder.step({s: (picks[s][len(t) - 1] if picks else t[-1]) for s, t in tokens.items()})
            for s, t in tokens.items():
                t.append(int(np.argmax(stepped[s])))
            logits += [stepped[first], stepped[second], stepped[third]]
        answers.append((logits, tokens))
    assert calls == [[width, width, len(short)], [width, width]]  # one call per step, the short slice in it
    narrow = [with_bf16.open([])[0] for _ in range(2)]  # wide slices holding fewer than BF16_PROMPT_TOKENS
    fills = [(s, prompts[0][: BF16_SLICE_TOKENS + 1], True) for s in narrow]
    with_bf16.step_with_prefills({s: 5 for s in with_bf16._ids}, fills)
    assert 2 * (BF16_SLICE_TOKENS + 1) < BF16_PROMPT_TOKENS and len(calls) == 2  # on the graph
    (bf16_logits, _), (float_logits, _) = answers
    for ours, theirs in zip(bf16_logits, float_logits, strict=True):
        spread = float(theirs.max() - theirs.min())
        assert float(np.abs(ours - theirs).max()) <= AGREEMENT * spread


def test_the_bf16_path_is_taken_only_where_it_agrees_pays_and_the_graph_rounds_activations(
    int4_runtime, tiny_engine_dir, monkeypatch, tmp_path
):
    import onnx
    from onnx import helper

    decoder = decoder_of(int4_runtime)
    path, names = Path(int4_runtime._folder) / "model.onnx", decoder._past

    def choice(run_alone):
        return faster_in_bf16(path, names, decoder._kv_shape, 1, run_alone)

    monkeypatch.setattr(bf16_prompts, "_bf16_matmul_in_hardware", lambda: False)
    assert choice(decoder._run_alone) is None  # no AMX / AVX-512 BF16: not even probed
    monkeypatch.setattr(bf16_prompts, "_bf16_matmul_in_hardware", lambda: True)  # the rest on any CPU

    # the probe's clock, moved by the calls it times: the verdict does not hang on this machine's speed
    now = [0.0]
    monkeypatch.setattr(bf16_prompts, "clock", lambda: now[0])

    def slower(seconds):
        def run_alone(tokens, cache):
            now[0] += seconds
            return decoder._run_alone(tokens, cache)

        return run_alone

    assert isinstance(choice(slower(0.5)), BfloatPrompts)  # agrees, and ONNX Runtime took longer
    run = BfloatPrompts.run
    monkeypatch.setattr(
        BfloatPrompts, "run", lambda self, slices: now.__setitem__(0, now[0] + 0.5) or run(self, slices)
    )
    assert choice(slower(0.1)) is None  # agrees, but slower here
    monkeypatch.setattr(BfloatPrompts, "run", run)

    def logits_apart(tokens, cache):
        logits, present = decoder._run_alone(tokens, cache)
        return logits + np.linspace(0, 0.2, logits.size) * float(logits.max() - logits.min()), present

    def cache_apart(tokens, cache):  # the same logits, the keys and values of the layers in another order
        logits, present = decoder._run_alone(tokens, cache)
        return logits, present[::-1]

    assert choice(logits_apart) is None  # faster or not: it does not compute what the graph does
    assert choice(cache_apart) is None
    # a lookup table that is not the lm_head's own is not taken for it
    model = onnx.load(path)
    gather = next(node for node in model.graph.node if node.op_type == "GatherBlockQuantized")
    scales = next(item for item in model.graph.initializer if item.name == gather.input[2])
    copy = onnx.TensorProto()
    copy.CopyFrom(scales)
    copy.name = "planted_scales"
    model.graph.initializer.append(copy)
    gather.input[2] = copy.name
    onnx.save(model, tmp_path / "model.onnx")
    assert GraphWeights.read(tmp_path / "model.onnx") is None
    # a graph with an operator the reader does not know is not read
    model = onnx.load(path)
    node = model.graph.node[-1]
    model.graph.node.append(helper.make_node("Relu", [node.output[0]], ["planted"]))
    onnx.save(model, tmp_path / "model.onnx")
    assert GraphWeights.read(tmp_path / "model.onnx") is None
    # fp32 weights and activations: bfloat16 would be less exact than the graph, so never chosen
    fp32 = load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1))
    assert fp32.batch_decoder().choose_bf16() is None
    # the runtime decides once and its later decoders take the decision made
    chosen = load_runtime(Path(int4_runtime._folder), TargetConfig(threads=1))
    path_taken = BfloatPrompts(graph_weights(int4_runtime), names)
    monkeypatch.setattr("tasks.engines.onnx.batch.faster_in_bf16", lambda *args: path_taken)
    first = chosen.batch_decoder()
    monkeypatch.setattr("tasks.engines.onnx.batch.faster_in_bf16", lambda *args: pytest.fail("decided twice"))
    second = chosen.batch_decoder()
    assert first._bf16 is path_taken and second._bf16 is path_taken


def test_buffers_reserved_before_the_first_request_change_no_answer(int4_runtime):
    """`reserve` sets up rows and positions ahead (what the server does with max_batch); requests then join and
    step in them exactly as in buffers grown on demand, and no buffer is reallocated until they outgrow it."""
    reserved, grown = decoder_of(int4_runtime), decoder_of(int4_runtime)
    reserved.reserve(8)
    store = reserved._store[0]
    assert store.shape[0] == 8 and store.shape[2] >= RESERVED_POSITIONS
    prompts = [[(k * index) % 200 + 3 for index in range(20 + k)] for k in range(3)]
    logits = []
    for decoder in (reserved, grown):
        rows = [decoder.add(prompt)[0] for prompt in prompts]
        logits.append([decoder.step({row: 7 for row in rows})[row] for row in rows])
    assert reserved._store[0] is store
    for ours, theirs in zip(*logits, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_reused_prompts_last_token_rides_in_the_bf16_call_after_its_copied_start(int4_runtime):
    """A newcomer whose prompt starts like a running row's holds that start already (copied keys and values) and
    has one token left: in a step with a long slice it runs in the bfloat16 call, after the copied positions, and
    its logits there and after the next step stay within AGREEMENT of the decoder without the path."""
    weights = graph_weights(int4_runtime)
    plain = decoder_of(int4_runtime)
    with_bf16 = decoder_of(int4_runtime, BfloatPrompts(weights, plain._past))
    calls: list[list[int]] = []
    run = with_bf16._bf16.run
    with_bf16._bf16.run = lambda slices: calls.append([len(t) for _, t in slices]) or run(slices)
    start = [(5 * index) % 240 + 5 for index in range(40)]
    long = [(11 * index) % 240 + 5 for index in range(BF16_PROMPT_TOKENS)]
    found = []
    for decoder in (with_bf16, plain):
        running, _ = decoder.add(start + [9])
        newcomer, held = decoder.open(start + [17])
        other, _ = decoder.open([])
        assert held == len(start)
        stepped, filled = decoder.step_with_prefills(
            {running: 3}, [(newcomer, [17], True), (other, long, True)]
        )
        after = decoder.step({running: 4, newcomer: 5, other: 6})
        found.append([filled[newcomer], after[newcomer], filled[other], after[other]])
    assert calls[-1] == [1, BF16_PROMPT_TOKENS]  # the last token in the same call as the long slice
    for ours, theirs in zip(*found, strict=True):
        spread = float(theirs.max() - theirs.min())
        assert float(np.abs(ours - theirs).max()) <= AGREEMENT * spread

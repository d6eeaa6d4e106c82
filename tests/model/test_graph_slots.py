"""The server's decoder for a compiled GPU target (tasks/engines/pytorch/graph_slots.py) on the CPU at fp32: the running
rows' step padded to its rows bucket and attending over a span bucket gives the tokens and logits of stepping each
sequence alone, while other rows are still filling (the padded rows must not touch them); the step is captured by
dynamo whole (a counting backend, as tests/model/test_decode_loop.py explains) once per (rows, span) bucket; the
server's scheduler drives it with budgeted prompts, KV waits and cancellation; a cuda runtime that compiles serves
through it. What it is for, CUDA graphs' speed, only `make gpu-check` on a GPU measures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.pytorch.graph_slots import GraphSlotDecoder, span_bucket
from tasks.engines.pytorch.runtime import TorchBatchDecoder
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.model.test_decode_loop import Counting, compile_budget, tiny_llama  # noqa: F401  (autouse: a whole budget per test)
from tests.model.test_torch_slots import drive

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
    [41, 42, 43, 44, 45],
    [50, 51, 52, 53, 54, 55, 56],
]


@pytest.fixture(scope="module")
def runtime(trained_base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("graph_slots") / "static"
    build_variant(
        "static", VariantConfig.model_validate({"runtime": {"kv_cache": "static"}}), trained_base, "d", folder
    )
    return load_runtime(folder, TargetConfig(threads=1))


def graph_decoder(runtime, compiler=None) -> GraphSlotDecoder:
    return GraphSlotDecoder(runtime.model, runtime._no_grad, runtime.device, compiler)


def test_span_buckets():
    assert [span_bucket(n, 4096) for n in (1, 256, 257, 600, 1025)] == [256, 256, 512, 1024, 2048]
    assert span_bucket(900, 700) == 700  # never past the buffers


@pytest.mark.parametrize("chunk", [0, 3])
def test_padded_steps_match_stepping_alone_while_other_rows_fill(runtime, chunk):
    """Two rows from the start, three joining at step 3 (whole, or in 3-token slices beside the running rows:
    then rows still filling sit in the padded rows' places), one leaving at step 6: each row's greedy tokens and its
    logits those of stepping it alone, to fp32 rounding."""
    alone_tokens, alone_logits = drive(
        TorchBatchDecoder(runtime.model, runtime._no_grad, runtime.device), PROMPTS, 14
    )
    decoder = graph_decoder(runtime)
    tokens, logits = drive(decoder, PROMPTS, 14, chunk=chunk)
    # sliced prompts start answering a few steps later: fewer tokens by the end, the same ones
    assert all(alone_tokens[i][: len(got)] == got and len(got) >= 4 for i, got in tokens.items())
    for key, row in logits.items():
        reference = alone_logits[key]
        assert np.abs(row - reference).max() <= 1e-4 * np.abs(reference).max(), key
    assert {rows for rows, _ in decoder.compile_s} >= {2, 4}  # three and four running rows ran as four


def test_reserve_compiles_each_rows_bucket_once_as_one_graph_and_steps_compile_no_more(runtime):
    """Through dynamo with `fullgraph` (a graph break fails): `reserve`, as the server calls it before the first
    request, compiles every rows bucket up to its rows at the shortest span, once each; steps of any count of rows
    then compile nothing more, and give the eager decoder's tokens."""
    counting = Counting()
    decoder = graph_decoder(runtime, counting.compiler)
    decoder.reserve(8)
    made = {(rows, 256) for rows in (1, 2, 4, 8)}
    assert counting.graphs == len(made) and set(decoder.compile_s) == made
    tokens, _ = drive(decoder, PROMPTS, 10, chunk=4)
    assert tokens == drive(graph_decoder(runtime), PROMPTS, 10, chunk=4)[0]
    for sequence in list(decoder._ids):  # every row left, the buffers kept
        decoder.remove(sequence)
    drive(decoder, PROMPTS[:3], 12)
    assert counting.graphs == len(made) and set(decoder.compile_s) == made


def test_the_scheduler_serves_through_it_with_budgeted_prompts_kv_waits_and_cancellation(
    runtime, monkeypatch
):
    """The server's own scheduler with the graph decoder (eager here): budgeted prompt slices beside the running rows,
    answers exactly each request's alone (fp32), a full KV budget makes requests wait, a cancelled one frees its
    row."""
    from tests.model.test_chunked_prefill import ARRIVING, RUNNING, kv_wait_and_cancel, serve_gated

    monkeypatch.setattr(runtime, "batch_decoder", lambda: graph_decoder(runtime))
    prompts = [
        runtime.encode(text) for text in (RUNNING, "A bridge", "Winter letters reach the hall.", ARRIVING)
    ]
    requests = [(prompts[0], 24), (prompts[1], 6), (prompts[2], 6), (prompts[3], 6)]
    answers, steps, _ = serve_gated(runtime, requests, max_batch=4, step_tokens=40)
    assert answers == [runtime.generate([prompt], n, stop_at_eos=False)[0] for prompt, n in requests]
    assert any(len(fills) >= 2 for _, fills in steps)  # prompts went in together
    kv_wait_and_cancel(runtime, lambda got, alone: got == alone)


def test_a_compiling_cuda_runtime_serves_through_the_graph_decoder(runtime, monkeypatch):
    """What `batch_decoder` hands the server: the graph decoder on a cuda target whose runtime compiles (its decode
    loop made), the padded batch on cuda without compiling, the one-at-a-time decoder for fp32 on the CPU."""
    assert type(runtime.batch_decoder()) is TorchBatchDecoder
    monkeypatch.setattr(runtime, "device", torch.device("cuda"))
    assert type(runtime.batch_decoder()).__name__ == "PaddedBatchDecoder"
    monkeypatch.setattr(runtime, "_loop", object())
    assert type(runtime.batch_decoder()) is GraphSlotDecoder


def test_inductor_compiled_step_gives_the_eager_tokens(runtime):
    """The step through inductor itself (its default mode: CUDA graphs need a GPU), one bucket (~10 s here)."""
    compiled = graph_decoder(runtime, lambda step: torch.compile(step, fullgraph=True, dynamic=False))
    assert drive(compiled, PROMPTS[:2], 5)[0] == drive(graph_decoder(runtime), PROMPTS[:2], 5)[0]
    assert set(compiled.compile_s) == {(2, 256)}


def test_decoders_past_the_processs_compile_budget_step_eagerly(runtime, monkeypatch):
    """A server makes a decoder per model version (and after a failed step), each compiling the same code again:
    past the process's budget the next decoder's buckets step eagerly, with the same tokens, where dynamo's
    recompile limit would make every step fail."""
    from tasks.engines.pytorch import decode_loop

    monkeypatch.setattr(decode_loop, "MAX_COMPILED_BUCKETS", 3)
    counting = Counting()
    first = graph_decoder(runtime, counting.compiler)
    first.reserve(4)  # buckets 1, 2, 4: the whole budget
    second = graph_decoder(runtime, counting.compiler)
    second.reserve(4)
    assert counting.graphs == 3 and second._eager == {(1, 256), (2, 256), (4, 256)}
    assert drive(second, PROMPTS, 8)[0] == drive(graph_decoder(runtime), PROMPTS, 8)[0]
    assert counting.graphs == 3


def test_padded_rows_do_not_change_a_rescaling_rotary_embedding_and_such_models_step_elsewhere():
    """A rotary embedding that rescales with the longest position it is given (dynamic): the padded rows, written
    at the spare position far past the model's context, are rotated as position 0, so the real rows get the
    rotation they get alone; the server's compiled decoder still leaves such models (and SDPA pinned to kernels
    without grouped-query attention under a mask) to the padded batch."""
    from tasks.engines.pytorch.graph_slots import graphs_in_slots

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_llama(max_position_embeddings=64, rope_parameters=rope)
    device = torch.device("cpu")
    alone_tokens, alone_logits = drive(TorchBatchDecoder(model, torch.inference_mode, device), PROMPTS[:3], 6)
    tokens, logits = drive(GraphSlotDecoder(model, torch.inference_mode, device, None), PROMPTS[:3], 6)
    assert tokens == alone_tokens
    for key, row in logits.items():  # 3 rows ran in the bucket of 4 from step 3 on
        assert np.abs(row - alone_logits[key]).max() <= 1e-4 * np.abs(alone_logits[key]).max(), key
    assert not graphs_in_slots(model, None)
    plain = tiny_llama()
    assert graphs_in_slots(plain, None) and graphs_in_slots(plain, "math")
    assert not graphs_in_slots(plain, "efficient") and not graphs_in_slots(plain, "cudnn")


def test_buffers_grown_mid_serve_count_their_buckets_compiles_again(runtime):
    """New buffers are new graph inputs: a bucket stepped again after the buffers grew compiles again, and the
    process's budget counts it (it would otherwise reach dynamo's limit while reading under it)."""
    from tasks.engines.pytorch import decode_loop

    counting = Counting()
    decoder = graph_decoder(runtime, counting.compiler)  # no `reserve`: the buffers start small and grow
    drive(decoder, PROMPTS, 8)  # two rows, then five (the buffers grow to eight rows), then four
    for sequence in list(decoder._ids):
        decoder.remove(sequence)
    drive(decoder, PROMPTS[:2], 4)  # two rows again, over the grown buffers
    assert counting.graphs == decode_loop._compiled_graphs["server decoder"] == 4

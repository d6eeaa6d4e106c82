"""Chunked prefill (serve.prefill_chunk) and prefix reuse (serve.prefix_reuse) in the engines that have them: a long
prompt joins in slices, each fused into one `llama_decode` with the running requests' next tokens (llama.cpp) or run
in its own call right after theirs (ONNX Runtime, whose graph takes one new-token count per call), so a running
stream never waits for a whole prompt; a shared start is computed once; the answers stay the unbatched greedy ones."""

from __future__ import annotations

import threading

import pytest

from serving.scheduler import GenerationRequest, Sampling, Scheduler
from tasks.engines import load_runtime

RUNNING = "The river walks the stone near the garden."
ARRIVING = " ".join(["Near the quiet forest 7, a train finds the book."] * 4)


@pytest.fixture(scope="module", params=["llama.cpp", "onnxruntime-genai"])
def llama(request, tiny_engine_dir):
    """Each engine with chunked prefill and prefix reuse (named for the first one)."""
    return load_runtime(tiny_engine_dir(request.param), threads=1)


def fused(runtime) -> bool:
    return runtime.manifest.engine == "llama.cpp"


def record(decoder, calls: list[list[tuple[int, int]]]) -> None:
    """Log each engine call of `decoder` as (sequence, tokens) items, sequences numbered in order of appearance."""
    numbers: dict[int, int] = {}

    def number(sequence: int) -> int:
        return numbers.setdefault(sequence, len(numbers))

    if hasattr(decoder, "_context"):  # llama.cpp: one llama_decode per call
        decode = decoder._context.decode

        def logged(work):
            calls.append([(number(sequence), len(tokens)) for sequence, tokens, _, _ in work])
            return decode(work)

        decoder._context.decode = logged
        return
    step, extend = decoder.step, decoder._extend  # ONNX Runtime: a step of every row, or one prompt's slice

    def logged_step(tokens):
        calls.append([(number(sequence), 1) for sequence in tokens])
        return step(tokens)

    def logged_extend(sequence, chunk):
        calls.append([(number(sequence), len(chunk))])
        return extend(sequence, chunk)

    decoder.step, decoder._extend = logged_step, logged_extend


def serve_two(
    runtime, prefill_chunk: int, first: list[int], second: list[int], budgets: tuple[int, int] = (120, 6)
) -> tuple[list[int], list[int], list[list[tuple[int, int]]], list]:
    """A long-running request (`first`), then `second` arriving once it streams; (their tokens, each engine call
    as (sequence in order of appearance, tokens) items, the decoders the scheduler made)."""
    calls: list[list[tuple[int, int]]] = []
    decoders = []
    make_decoder = runtime.batch_decoder

    def recorded():
        decoder = make_decoder()
        record(decoder, calls)
        decoders.append(decoder)
        return decoder

    runtime.batch_decoder = recorded
    try:
        scheduler = Scheduler(runtime, max_batch=4, max_queue=4, prefill_chunk=prefill_chunk)
        tokens: dict[str, list[int]] = {"first": [], "second": []}
        streaming, done = threading.Event(), threading.Semaphore(0)

        def collect(name):
            def on_event(event):
                if event[0] == "token":
                    tokens[name].append(event[1][0])
                    if len(tokens[name]) == 2:
                        streaming.set()
                elif event[0] in ("done", "error"):
                    assert event[0] == "done", event
                    done.release()

            return on_event

        scheduler.submit(GenerationRequest(first, budgets[0], Sampling(), collect("first")))
        assert streaming.wait(30)
        scheduler.submit(GenerationRequest(second, budgets[1], Sampling(), collect("second")))
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        scheduler.close()
    finally:
        del runtime.batch_decoder
    return tokens["first"], tokens["second"], calls, decoders


def test_a_long_prompt_arrives_in_slices_beside_the_running_stream_and_answers_do_not_change(llama):
    prompt = llama.encode(ARRIVING)
    assert len(prompt) > 24
    running, arriving, calls, _ = serve_two(llama, 8, llama.encode(RUNNING), prompt)
    assert running == llama.generate([llama.encode(RUNNING)], 120, stop_at_eos=False)[0]
    assert arriving == llama.generate([prompt], 6, stop_at_eos=False)[0]
    # the running request is sequence 0, the newcomer sequence 1
    slices = [i for i, call in enumerate(calls) if any(sequence == 1 and size > 1 for sequence, size in call)]
    assert len(slices) == -(-len(prompt) // 8)  # in slices of 8 tokens ...
    for i in slices:  # ... each beside the running stream's next token: in the same call, or the one before
        beside = calls[i] if fused(llama) else calls[i - 1] + calls[i]
        assert sorted(beside)[0] == (0, 1) and len(beside) == 2 and max(size for _, size in beside) <= 8

    _, _, whole, _ = serve_two(llama, 0, llama.encode(RUNNING), prompt)
    assert [(1, len(prompt))] in whole  # unchunked, the stream waits while the whole prompt runs alone


@pytest.mark.parametrize("prefill_chunk", [0, 8])
def test_a_prompt_sharing_a_running_requests_start_reuses_its_cache_and_answers_the_same(
    llama, prefill_chunk
):
    """The shared start is computed once: the newcomer's calls carry only the rest of its prompt."""
    shared = llama.encode(RUNNING)
    newcomer = shared + llama.encode(" Then the train finds the quiet forest.")
    first, second, calls, decoders = serve_two(llama, prefill_chunk, shared, newcomer, budgets=(60, 6))
    assert second == llama.generate([newcomer], 6, stop_at_eos=False)[0]
    assert first == llama.generate([shared], 60, stop_at_eos=False)[0]
    assert decoders[0].reused_tokens == len(shared)
    computed = sum(size for call in calls for sequence, size in call if sequence == 1 and size > 1)
    assert computed == len(newcomer) - len(shared)  # only the new part of its prompt ran


def test_several_long_prompts_arriving_together_are_fed_in_turn_and_answer_as_alone(llama):
    prompts = [
        llama.encode(ARRIVING),
        llama.encode(" ".join(["A bridge over the river 3 holds the market."] * 3)),
        llama.encode(RUNNING),
        llama.encode(" ".join(["Winter letters reach the village music hall."] * 5)),
    ]
    scheduler = Scheduler(llama, max_batch=4, max_queue=8, prefill_chunk=8)
    answers: list[list[int]] = [[] for _ in prompts]
    finished = threading.Semaphore(0)

    def collect(index):
        def on_event(event):
            if event[0] == "token":
                answers[index].append(event[1][0])
            else:
                assert event[0] == "done", event
                finished.release()

        return on_event

    for index, prompt in enumerate(prompts):
        scheduler.submit(GenerationRequest(prompt, 8, Sampling(), collect(index)))
    assert all(finished.acquire(timeout=60) for _ in prompts)
    scheduler.close()
    assert answers == [llama.generate([prompt], 8, stop_at_eos=False)[0] for prompt in prompts]


def test_the_offline_same_mix_ceiling_runs_every_request_through_the_scheduler(llama):
    from serving.loadtest import LoadRequest, offline_same_mix

    requests = [LoadRequest(RUNNING, 6), LoadRequest(ARRIVING, 4), LoadRequest("A bridge", 5)]
    assert offline_same_mix(llama, requests, clients=8, max_batch=2, prefill_chunk=8) > 0
    assert offline_same_mix(llama, requests, clients=1, max_batch=2) > 0

"""Chunked prefill (serve.prefill_chunk) and prefix reuse (serve.prefix_reuse) in the engines that have them: a long
prompt joins in slices, each fused into one `llama_decode` with the running requests' next tokens (llama.cpp) or run
in its own call right after theirs (ONNX Runtime, whose graph takes one new-token count per call), so a running
stream never waits for a whole prompt; a shared start is computed once; the answers stay the unbatched greedy ones."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest

from serving.sampling import Sampling
from serving.scheduler import GenerationRequest, Scheduler
from tasks.config import TargetConfig
from tasks.engines import load_runtime

RUNNING = "The river walks the stone near the garden."
ARRIVING = " ".join(["Near the quiet forest 7, a train finds the book."] * 4)


@pytest.fixture(scope="module", params=["llama.cpp", "onnxruntime-genai"])
def llama(request, tiny_engine_dir):
    """Each engine with chunked prefill and prefix reuse (named for the first one)."""
    return load_runtime(tiny_engine_dir(request.param), TargetConfig(threads=1))


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
    if hasattr(decoder, "_run"):  # torch's slot decoder: one forward call per step, slices included
        run = decoder._run

        def logged_run(tokens, fills):
            calls.append([(number(s), 1) for s in tokens] + [(number(s), len(c)) for s, c, _ in fills])
            return run(tokens, fills)

        decoder._run = logged_run
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
    joined = next(
        i for i, call in enumerate(whole) if (1, len(prompt)) in call
    )  # within the step budget: whole
    beside = whole[joined] if fused(llama) else whole[joined - 1] + whole[joined]
    assert sorted(beside) == [(0, 1), (1, len(prompt))]  # ... and still beside the running stream's token


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
    answers, _, _ = serve_gated(llama, [(prompt, 8) for prompt in prompts], max_batch=4, prefill_chunk=8)
    assert answers == [llama.generate([prompt], 8, stop_at_eos=False)[0] for prompt in prompts]


def test_a_bursts_slices_run_shortest_first_each_answering_before_the_next_call_and_share_their_starts(
    tiny_engine_dir,
):
    """ONNX Runtime (a call per slice): in a step that carries three newcomers beside a running request, the
    running request's token goes out before any prompt call, the slices run shortest first, each request's first
    token goes out before the next slice's call, and a prompt that starts like one computed earlier in the step
    computes only the rest (even though that one ended on its first token and left). Answers as alone."""
    runtime = load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1))
    shared = runtime.encode(RUNNING)
    longer = shared + runtime.encode(" Then the train finds the quiet forest.")
    requests = [(runtime.encode("A bridge"), 12), (runtime.encode(ARRIVING), 4), (longer, 4), (shared, 1)]
    timeline: list[
        tuple[str, int]
    ] = []  # ("call", tokens) per prompt call, ("token", request) per token sent
    with prompt_calls(runtime, timeline):
        answers, _, _ = serve_gated(runtime, requests, max_batch=4, timeline=timeline)
    assert answers == [runtime.generate([prompt], n, stop_at_eos=False)[0] for prompt, n in requests]
    burst = timeline.index(("call", len(shared)))
    assert timeline[burst - 1 : burst + 6] == [
        ("token", 0),  # the running request's second token, before the prompt calls
        ("call", len(shared)),  # the shortest slice first; its request ends on this token and leaves
        ("token", 3),
        ("call", len(longer) - len(shared)),  # only what it does not share with the one computed before it
        ("token", 2),
        ("call", len(requests[1][0])),
        ("token", 1),
    ], timeline


@contextlib.contextmanager
def prompt_calls(runtime, log: list[tuple[str, int]]):
    """While inside, the ONNX decoders `runtime` makes log each prompt call as ("call", tokens it computes)."""
    make = runtime.batch_decoder

    def traced():
        decoder = make()
        run_alone = decoder._run_alone

        def logged(chunk, cache, long=True):
            log.append(("call", len(chunk)))
            return run_alone(chunk, cache, long)

        decoder._run_alone = logged
        return decoder

    runtime.batch_decoder = traced
    try:
        yield
    finally:
        del runtime.batch_decoder


def test_the_offline_same_mix_ceiling_runs_every_request_through_the_scheduler(llama):
    from serving.loadtest import LoadRequest, offline_same_mix
    from serving.models import Limits

    requests = [LoadRequest(RUNNING, 6), LoadRequest(ARRIVING, 4), LoadRequest("A bridge", 5)]
    assert offline_same_mix(llama, requests, 8, Limits(max_batch=2, max_queue=4, prefill_chunk=8)) > 0
    assert offline_same_mix(llama, requests, 1, Limits(max_batch=2, max_queue=4)) > 0


def rows_and_fills(decoder, steps: list[tuple[int, list[int]]]) -> None:
    """Log each scheduling step of `decoder` as (running rows, [size of each prompt slice])."""
    step, stream = decoder.step, decoder.stream_step
    inside = []  # a step inside a logged one (ONNX's stream, llama.cpp's fused call): one step, logged once

    def logged_step(tokens):
        if not inside:
            steps.append((len(tokens), []))
        inside.append(True)
        try:
            return step(tokens)
        finally:
            inside.pop()

    def logged_stream(tokens, fills):
        if not inside:
            steps.append((len(tokens), [len(chunk) for _, chunk, _ in fills]))
        inside.append(True)
        try:
            yield from stream(tokens, fills)
        finally:
            inside.pop()

    decoder.step, decoder.stream_step = logged_step, logged_stream


def serve_gated(
    runtime, requests: list[tuple[list[int], int]], kv_tokens=None, cancel_first_at=0, timeline=None, **limits
):
    """Serve `requests` (prompt, max_tokens) through a scheduler whose first prompt step waits until all of them
    are queued, the first cancelled after `cancel_first_at` tokens if set, each token sent logged to `timeline`
    as ("token", request) if given; (their tokens, each step as (running rows, prompt slice sizes), each engine
    call)."""
    from tests.model.test_serving_limits import GatedRuntime

    steps, calls = [], []
    gated = GatedRuntime(_Recorded(runtime, steps, calls, kv_tokens))
    scheduler = Scheduler(gated, max_queue=8, **limits)
    answers: list[list[int]] = [[] for _ in requests]
    finished = threading.Semaphore(0)

    def collect(index):
        def on_event(event):
            if event[0] == "token":
                answers[index].append(event[1][0])
                if timeline is not None:
                    timeline.append(("token", index))
                if index == 0 and len(answers[0]) == cancel_first_at:
                    first.cancel()
            else:
                assert event[0] == "done", event
                finished.release()

        return on_event

    first = GenerationRequest(requests[0][0], requests[0][1], Sampling(), collect(0))
    scheduler.submit(first)
    assert scheduler.wait_for(lambda s: s.queued == 0, 30)  # the first is taken, its prompt step held
    for index, (prompt, budget) in enumerate(requests[1:], start=1):
        scheduler.submit(GenerationRequest(prompt, budget, Sampling(), collect(index)))
    gated.gate.set()
    assert all(finished.acquire(timeout=60) for _ in requests)
    scheduler.close()
    assert gated.decoders[-1].active == 0 and scheduler.in_flight == 0
    return answers, steps, calls


class _Recorded:
    """`runtime`, its decoders logged by `rows_and_fills` and `record`, with `kv_tokens` of KV room if given."""

    def __init__(self, runtime, steps: list, calls: list, kv_tokens: int | None) -> None:
        self._runtime, self._steps, self._calls, self._kv_tokens = runtime, steps, calls, kv_tokens

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)

    def batch_decoder(self):
        decoder = self._runtime.batch_decoder()
        record(decoder, self._calls)
        rows_and_fills(decoder, self._steps)
        if self._kv_tokens is not None:
            decoder.kv_tokens = self._kv_tokens
        return decoder


def test_prompts_waiting_together_join_in_one_step_under_the_token_budget_and_answer_as_alone(llama):
    """Newcomers join the same step while the budget lasts (one llama_decode for all in llama.cpp); a prompt
    longer than what is left is sliced; no step carries more than `step_tokens` tokens."""
    first, short, medium = (
        llama.encode(text) for text in (RUNNING, "A bridge", "Winter letters reach the hall.")
    )
    long = llama.encode(ARRIVING)
    budget = 40
    assert len(long) > budget and 1 + len(short) + len(medium) < budget  # beside the first one's token
    requests = [(first, 30), (short, 6), (medium, 6), (long, 6)]
    answers, steps, calls = serve_gated(llama, requests, max_batch=4, step_tokens=budget)
    assert answers == [llama.generate([prompt], n, stop_at_eos=False)[0] for prompt, n in requests]
    assert all(rows + sum(fills) <= budget for rows, fills in steps), steps
    together = next(fills for _, fills in steps if len(fills) == 3)  # short, medium and the long one's start
    assert together[:2] == [len(short), len(medium)] and 0 < together[2] < len(long)
    assert sum(size for _, fills in steps for size in fills) == sum(len(p) for p, _ in requests)
    if fused(llama):  # a step is one engine call, whatever it carries
        assert len(calls) == len(steps)


def test_a_full_kv_cache_makes_requests_wait_and_a_cancelled_one_frees_its_room(llama):
    """With KV room for two requests, four never run more than two at once: the others wait in the queue (no
    engine error, no refusal: only a full queue refuses). A cancelled request's cells go to the next in line."""
    kv_wait_and_cancel(llama, lambda got, alone: got == alone)


def kv_wait_and_cancel(runtime, same: Callable[[list[list[int]], list[list[int]]], bool]) -> None:
    """Four requests of 40 KV cells each with room for 90 run at most two at once, and answer as each alone
    (`same`: exactly, or to the engine's tolerance); with room for one, a request cancelled after 3 tokens
    leaves its room to the next in line, which then runs to its budget."""
    texts = (RUNNING, "A bridge over the river", "Winter letters", "The train")
    prompts = [runtime.encode(text) for text in texts]
    requests = [(prompt, 40 - len(prompt)) for prompt in prompts]  # each needs 40 cells
    answers, steps, _ = serve_gated(runtime, requests, kv_tokens=90, max_batch=4, step_tokens=64)
    assert same(answers, [runtime.generate([prompt], n, stop_at_eos=False)[0] for prompt, n in requests])
    assert max(rows + len(fills) for rows, fills in steps) == 2, steps

    requests = [
        (prompts[0], 400),
        (prompts[1], 8),
    ]  # room for one: the second runs once the first is cancelled
    answers, steps, _ = serve_gated(runtime, requests, kv_tokens=430, cancel_first_at=3, max_batch=4)
    assert len(answers[0]) == 3
    assert same(answers[1:], [runtime.generate([prompts[1]], 8, stop_at_eos=False)[0]])
    assert max(rows + len(fills) for rows, fills in steps) == 1, steps


def serve_in_turn(runtime, requests: list[tuple[list[int], int]], **limits) -> tuple[list[list[int]], list]:
    """Each request after the previous one has finished; (their tokens, the decoders the scheduler made)."""
    decoders, make_decoder = [], runtime.batch_decoder

    def recorded():
        decoders.append(make_decoder())
        return decoders[-1]

    runtime.batch_decoder = recorded
    answers = []
    try:
        scheduler = Scheduler(runtime, max_batch=4, max_queue=4, **limits)
        for prompt, budget in requests:
            tokens, done = [], threading.Event()

            def on_event(event, tokens=tokens, done=done):
                if event[0] == "token":
                    tokens.append(event[1][0])
                elif event[0] in ("done", "error"):
                    assert event[0] == "done", event
                    done.set()

            scheduler.submit(GenerationRequest(prompt, budget, Sampling(), on_event))
            assert done.wait(60)
            answers.append(tokens)
        scheduler.close()
    finally:
        del runtime.batch_decoder
    return answers, decoders


def test_a_finished_requests_cache_serves_a_later_prompt_that_starts_like_it(llama):
    """serve.prefix_cache_tokens: the first request has ended when the second arrives; its keys and values stayed
    in the cache, so the second computes only what follows the shared start, and answers as alone."""
    from tasks.engines.contract import common_prefix

    first = llama.encode(RUNNING)
    second = first + llama.encode(" Then the train finds the quiet forest.")
    (answer, later), decoders = serve_in_turn(llama, [(first, 6), (second, 6)])
    assert later == llama.generate([second], 6, stop_at_eos=False)[0]
    held = first + answer[:-1]  # the last token chosen is never fed
    assert decoders[0].reused_tokens == common_prefix(held, second, limit=len(second) - 1) >= len(first)
    (_, again), decoders = serve_in_turn(llama, [(first, 6), (second, 6)], prefix_cache_tokens=0)
    assert again == later and decoders[0].reused_tokens == 0  # off: only running requests share


def test_the_finished_sequences_kept_are_the_most_recently_used_within_the_budget(llama):
    a = llama.encode(RUNNING)
    b = llama.encode(" ".join(["Winter letters reach the village music hall."] * 3))
    tail = llama.encode(" Then the train finds the quiet forest.")
    decoder = llama.batch_decoder()
    decoder.retain_tokens = max(len(a), len(b)) + 2  # room for one of them
    for prompt in (a, b):
        sequence, _ = decoder.add(prompt)
        decoder.remove(sequence)
    newest, held_b = decoder.open(b + tail)
    oldest, held_a = decoder.open(a + tail)
    assert held_b == len(b) and held_a < len(a)  # b pushed a out (a may share a first token with b)
    decoder.remove(newest)
    decoder.remove(oldest)
    decoder.retain_tokens = 0
    sequence, _ = decoder.add(a)
    decoder.remove(sequence)
    assert decoder.open(a + tail)[1] < len(a)  # nothing kept with no budget


def test_llama_cpps_kept_copies_take_no_more_than_a_quarter_of_the_free_memory(tiny_engine_dir, monkeypatch):
    """llama.cpp keeps a finished sequence as a copy of its cells in memory (its stream freed for the next one),
    within `retain_tokens` and a quarter of the free memory; a newcomer continuing a kept one gets it back."""
    from tasks.engines import contract

    runtime = load_runtime(tiny_engine_dir("llama.cpp"), TargetConfig(threads=1))
    a, b = (
        runtime.encode(RUNNING),
        runtime.encode(" ".join(["Winter letters reach the village music hall."] * 3)),
    )
    tail = runtime.encode(" Then the train finds the quiet forest.")
    per_token = runtime._model.kv_bytes_per_token
    monkeypatch.setattr(
        contract, "free_memory", lambda: 4 * per_token * (max(len(a), len(b)) + 2)
    )  # one of them
    decoder = runtime.batch_decoder()
    decoder.rows, decoder.retain_tokens = 2, 100_000
    for prompt in (a, b):
        sequence, _ = decoder.add(prompt)
        decoder.remove(sequence)
    assert decoder.active == 0 and len(decoder._retained.keys()) == 1  # b's copy; a's went for the memory
    later, held = decoder.open(b + tail)
    assert held == len(b)
    decoder.remove(later)
    assert decoder.open(a + tail)[1] < len(a)


def test_the_onnx_decoders_kept_copies_take_no_more_than_a_quarter_of_the_free_memory(
    tiny_engine_dir, monkeypatch
):
    """The ONNX decoder keeps copies of finished sequences' keys and values: within `retain_tokens` and within a
    quarter of the memory still free (`retain_budget`), whichever is less."""
    from tasks.engines import contract

    runtime = load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1))
    prompt = runtime.encode(RUNNING)
    tail = runtime.encode(" Then the train finds the quiet forest.")
    decoder = runtime.batch_decoder()
    decoder.retain_tokens = 100_000
    sequence, _ = decoder.add(prompt)
    per_token = sum(store[0, :, :1].nbytes for store in decoder._store)
    for free, kept in ((4 * per_token * (len(prompt) - 1), False), (4 * per_token * len(prompt), True)):
        monkeypatch.setattr(contract, "free_memory", lambda free=free: free)
        decoder.remove(sequence)  # kept, or not
        opened, held = decoder.open(prompt + tail)
        assert (held == len(prompt)) == kept
        decoder.remove(opened)
        sequence, _ = decoder.add(prompt)
    monkeypatch.setattr(contract, "free_memory", lambda: 4 * per_token)  # memory went: what is kept goes too
    decoder.remove(sequence)
    assert decoder.open(prompt + tail)[1] < len(prompt)


def test_a_prompt_one_slice_behind_another_that_starts_alike_computes_only_what_they_do_not_share(
    tiny_engine_dir,
):
    """ONNX, prompts in slices of 8: the second prompt joins a step after the first, which is still filling; at
    each of its slices it takes the first one's keys and values for what they share (a prompt still joining is a
    source too) and computes one token of it at most (a slice always computes its last); answers as alone."""
    runtime = load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1))
    shared = runtime.encode(" ".join([RUNNING] * 3))
    ahead = shared + runtime.encode(" Then the train finds the quiet forest.")
    behind = shared + runtime.encode(" A bridge over the river 3 holds the market.")
    calls: list[tuple[str, int]] = []
    with prompt_calls(runtime, calls):
        answers, steps, _ = serve_gated(runtime, [(ahead, 4), (behind, 4)], max_batch=2, prefill_chunk=8)
    assert answers == [runtime.generate([prompt], 4, stop_at_eos=False)[0] for prompt in (ahead, behind)]
    assert any(fills == [8, 8] for _, fills in steps)  # both filling in one step: the second one slice behind
    slices_of_shared = -(-len(shared) // 8)
    computed = sum(tokens for _, tokens in calls)
    assert computed <= len(ahead) + (len(behind) - len(shared)) + slices_of_shared, calls

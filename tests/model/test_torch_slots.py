"""The torch engine's slot decoder (tasks/engines/pytorch/slots.py) on the trained tiny model in bfloat16: every running
sequence in one call per step, sequences joining and leaving between steps, each row at its own position; its logits
match stepping each sequence alone to bfloat16 rounding (the tolerance below), as the padded batch on a GPU does."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.config import ServeConfig, TargetConfig
from tasks.engines import load_runtime
from tasks.engines.pytorch.runtime import TorchBatchDecoder
from tasks.engines.pytorch.slots import SlotBatchDecoder, steps_in_slots
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant

# Largest |logit difference| / largest |logit| against stepping alone, while the two have chosen the same tokens:
# bfloat16 keeps 8 bits of mantissa and a batch changes the order of the sums. Measured 0.0075 here (all 60 rows
# compared; 0.032 on SmolLM2-135M, where transformers' own padded batch gives 0.035); a rotary embedding one position
# off gives 0.053, keys not written 0.23
TOLERANCE = 0.025


@pytest.fixture(scope="module")
def bf16_runtime(trained_base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("slots") / "bf16"
    build_variant(
        "bf16", VariantConfig.model_validate({"runtime": {"dtype": "bfloat16"}}), trained_base, "d", folder
    )
    return load_runtime(folder, TargetConfig(threads=1))


@pytest.fixture(params=["packed", "plain"])
def packing(request, monkeypatch) -> bool:
    """Each slot test twice: the linear maps packed for oneDNN where this CPU's torch can (`_packs`), and plain
    `F.linear` on the model's own weights."""
    import weakref

    from tasks.engines.pytorch import slots as torch_slots

    monkeypatch.setattr(torch_slots, "_PACKED", weakref.WeakKeyDictionary())
    if request.param == "plain":
        monkeypatch.setattr(torch_slots, "_packs", lambda model: False)
    return request.param == "packed"


def uses(decoder, packing: bool, runtime) -> None:
    """`decoder` runs the packed maps exactly when asked to and the CPU allows it."""
    from tasks.engines.pytorch.slots import _packs

    assert decoder._weights[0][0].packed == (packing and _packs(runtime.model))


def drive(
    decoder, prompts: list[list[int]], steps: int, chunk: int = 0, leave: int = 1, forced: dict | None = None
) -> tuple[dict[int, list[int]], dict]:
    """Two prompts from the start, the others joining at step 3, prompt `leave` leaving at step 6 (the second: a
    row in the middle of the buffer; or one still filling): each prompt's greedy tokens, and its logits by (prompt, tokens so far). With `chunk`, the
    joining prompts are opened at step 3 and fed in slices of at most `chunk` tokens beside the running rows
    (`step_with_prefills`), each step all of them; without, each runs alone (`add`). With `forced` (another run's
    tokens), each prompt is fed those tokens instead of its own argmax, so the two runs' histories are the same and
    every row compares (a bfloat16 near tie would otherwise part them, at a place that depends on the CPU)."""
    sequences, tokens, logits = {}, {}, {}

    def choose(index: int, row) -> int:
        done = len(tokens.get(index, []))
        if forced is not None and done < len(forced.get(index, [])):
            return forced[index][done]
        return int(np.argmax(row))

    filling: dict[int, tuple[int, int]] = {}  # opened sequence: (prompt index, tokens fed)

    def first(index: int, sequence: int, row) -> None:
        sequences[sequence], tokens[index] = index, [choose(index, row)]
        logits[(index, 1)] = row

    for index in (0, 1):
        first(index, *decoder.add(prompts[index]))
    for step in range(steps):
        if step == 3:
            for index in range(2, len(prompts)):
                if chunk:
                    sequence, held = decoder.open(prompts[index])
                    filling[sequence] = (index, held)
                else:
                    first(index, *decoder.add(prompts[index]))
        if step == 6:
            held = [*sequences.items(), *((s, i) for s, (i, _) in filling.items())]
            leaving = next(s for s, i in held if i == leave)
            decoder.remove(leaving)
            sequences.pop(leaving, None)
            filling.pop(leaving, None)
        fills = []
        for sequence, (index, fed) in filling.items():
            part = prompts[index][fed : fed + chunk]
            fills.append((sequence, part, fed + len(part) == len(prompts[index])))
            filling[sequence] = (index, fed + len(part))
        running = {s: tokens[i][-1] for s, i in sequences.items()}
        stepped, filled = decoder.step_with_prefills(running, fills) if fills else (decoder.step(running), {})
        for sequence, row in stepped.items():
            index = sequences[sequence]
            tokens[index].append(choose(index, row))
            logits[(index, len(tokens[index]))] = row
        for sequence, _, last in fills:
            if last:
                first(filling.pop(sequence)[0], sequence, filled[sequence])
    return tokens, logits


def assert_close(got, got_logits, want, want_logits) -> None:
    """Every logit row of `got` within TOLERANCE of `want`'s while the two have chosen the same tokens; most rows
    compared."""
    compared = 0
    for (index, count), row in got_logits.items():
        if got[index][: count - 1] != want[index][: count - 1]:
            continue  # a near tie went the other way earlier: the histories differ from here on
        reference = want_logits[(index, count)]
        assert np.abs(row - reference).max() <= TOLERANCE * np.abs(reference).max(), (index, count)
        compared += 1
    assert compared >= 0.8 * len(got_logits)


def test_half_precision_llama_shaped_models_step_in_slots_and_fp32_steps_alone(
    bf16_runtime, baseline_runtime
):
    assert steps_in_slots(bf16_runtime.model)
    assert type(bf16_runtime.batch_decoder()) is SlotBatchDecoder
    assert (
        type(baseline_runtime.batch_decoder()) is TorchBatchDecoder
    )  # fp32: results independent of the batch


def test_slot_steps_match_stepping_alone_to_bfloat16_rounding_as_sequences_join_and_leave(
    bf16_runtime, packing
):
    runtime = bf16_runtime
    texts = [
        "river stone quiet",
        "market bread letter window garden winter",
        "train",
        "music teacher student paper",
    ]
    # six prompts: more rows than the buffer starts with (4), one longer than its first positions (256)
    prompts = [runtime.encode(t) for t in texts] + [
        runtime.encode("light shadow " * 150),
        runtime.encode("fire"),
    ]
    assert len(prompts[4]) > 256
    slots = SlotBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    alone = TorchBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    uses(slots, packing, runtime)
    want, want_logits = drive(alone, prompts, 12)
    got, got_logits = drive(slots, prompts, 12, forced=want)
    assert slots.active == alone.active == len(prompts) - 1
    assert_close(got, got_logits, want, want_logits)
    # one engine call per step for every sequence (plus one per prompt), where stepping alone makes one per row
    assert slots.steps == len(prompts) + 12 < alone.steps


def test_joining_prompts_share_the_running_rows_call_in_slices_and_match_stepping_alone(
    bf16_runtime, packing
):
    """Four prompts join while two run, fed in slices of 16 tokens beside the running rows' tokens: one forward
    call per step for all of them (the 300-token prompt takes 19 steps), and every row's logits match stepping
    alone to bfloat16 rounding, before and after a running row leaves."""
    runtime = bf16_runtime
    texts = ["river stone quiet", "market bread letter window garden winter", "train", "music teacher"]
    prompts = [runtime.encode(t) for t in texts] + [runtime.encode("light shadow " * 150)[:300]]
    assert len(prompts[4]) == 300
    slots = SlotBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    slots.reuse_prefixes = False
    alone = TorchBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    uses(slots, packing, runtime)
    want, want_logits = drive(alone, prompts, 30)
    got, got_logits = drive(slots, prompts, 30, chunk=16, forced=want)
    assert slots.active == alone.active == len(prompts) - 1
    assert all(len(got[i]) > 1 for i in range(len(prompts)))  # the long one joined and ran
    assert_close(got, got_logits, want, want_logits)
    # the two first prompts alone, then one call per step, prompt slices included
    assert slots.steps == 2 + 30


def test_a_prompt_removed_while_filling_leaves_the_other_rows_whole(bf16_runtime):
    """An 80-token prompt is dropped at step 6, halfway in (a cancelled request), while the 300-token one opened
    after it keeps filling: the rows running and the prompt still filling go on as if it had never come."""
    runtime = bf16_runtime
    texts = ["river stone quiet", "market bread letter window garden winter", "train"]
    prompts = (
        [runtime.encode(t) for t in texts]
        + [
            runtime.encode("music teacher " * 40)[:80],  # still filling at step 6, in slices of 16
            runtime.encode("light shadow " * 150)[:300],  # a filling row after it
        ]
    )
    slots = SlotBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    slots.reuse_prefixes = False
    alone = TorchBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    want, want_logits = drive(alone, prompts, 26, leave=3)
    got, got_logits = drive(slots, prompts, 26, chunk=16, leave=3, forced=want)
    assert 3 not in got and slots.active == alone.active == len(prompts) - 1
    assert all(len(got[i]) > 1 for i in (0, 1, 2, 4))  # the long one joined and ran
    assert_close(got, got_logits, {i: t for i, t in want.items() if i != 3}, want_logits)


@pytest.mark.parametrize("pack", [True, False])
def test_fused_maps_with_biases_give_each_maps_own_output(pack):
    """q, k and v (Qwen2's carry biases; a map without one gets zeros) in one call: the outputs side by side are
    each map's own, packed or plain."""
    import torch

    from tasks.engines.pytorch.linears import LinearMaps

    torch.manual_seed(0)
    maps = [
        torch.nn.Linear(64, size, bias=bias).to(torch.bfloat16)
        for size, bias in ((64, True), (32, False), (32, True))
    ]
    probe = torch.nn.Linear(64, 8, bias=False).to(torch.bfloat16)
    if pack and not _can_pack(probe):
        pack = False  # this CPU's torch has no oneDNN bfloat16 matmul: the plain path is what runs here
    fused = LinearMaps(maps, pack)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = torch.cat([torch.nn.functional.linear(x, m.weight, m.bias) for m in maps], dim=-1)
    got = fused(x)
    assert fused.sizes == [64, 32, 32] and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=0.02, atol=0.02)
    assert fused.packed == pack


def _can_pack(linear) -> bool:
    import torch

    try:
        from tasks.engines.pytorch.linears import LinearMaps

        LinearMaps([linear], True)(torch.zeros(1, linear.weight.shape[1], dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError):
        return False


def test_a_prompt_starting_like_a_running_or_finished_sequence_reuses_its_cache(bf16_runtime):
    """A newcomer whose prompt starts like a running row's tokens, or a finished one's kept in `retain_tokens`,
    computes only the rest of its prompt, and answers as it does alone."""
    runtime = bf16_runtime
    shared = runtime.encode("the quiet river walks past the stone garden and the old market")
    prompts = [shared + runtime.encode(" bread"), shared + runtime.encode(" letter window")]
    slots = SlotBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    slots.retain_tokens = 1024
    alone = TorchBatchDecoder(runtime.model, runtime._no_grad, runtime.device)
    _, fresh = alone.add(prompts[1])
    runner, _ = slots.add(prompts[0])
    sequence, held = slots.open(prompts[1])
    assert held == len(shared)  # from the running row
    _, filled = slots.step_with_prefills({runner: 5}, [(sequence, prompts[1][held:], True)])
    assert np.abs(filled[sequence] - fresh).max() <= TOLERANCE * np.abs(fresh).max()
    slots.remove(runner)
    slots.remove(sequence)
    again, held = slots.open(prompts[1])
    assert held == len(prompts[1]) - 1 and slots.reused_tokens == len(shared) + held  # from the kept copy
    _, filled = slots.step_with_prefills({}, [(again, prompts[1][held:], True)])
    assert np.abs(filled[again] - fresh).max() <= TOLERANCE * np.abs(fresh).max()


def test_the_server_serves_a_bf16_variant_through_the_slot_decoder(bf16_runtime):
    from serving.models import Limits
    from tasks.measure.served import LoadRequest, replay

    requests = [
        LoadRequest(text, 6) for text in ("river stone", "quiet morning market", "bread", "letter window")
    ]
    outcomes, wall = replay(bf16_runtime, requests, 4, Limits.of(ServeConfig()), stop_at_eos=False)
    assert [o.status for o in outcomes] == [200] * 4 and all(o.tokens == 6 for o in outcomes) and wall > 0


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens two sets of greedy answers have in common, position by position."""
    same = sum(a == b for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
    return same / sum(len(y) for y in want)


def test_the_scheduler_feeds_waiting_prompts_into_the_running_rows_call_under_the_token_budget(bf16_runtime):
    """Through the server's scheduler: newcomers join the same forward call as the running request while the
    budget lasts, the long one sliced; no step carries more than `step_tokens`; one engine call per step; the
    answers are those the requests get alone (to bfloat16 rounding: identical here, where a near tie could flip
    one)."""
    from tests.model.test_chunked_prefill import ARRIVING, RUNNING, serve_gated

    runtime = bf16_runtime
    first, short, medium = (
        runtime.encode(t) for t in (RUNNING, "A bridge", "Winter letters reach the hall.")
    )
    long = runtime.encode(ARRIVING)
    budget = 40
    assert len(long) > budget and 1 + len(short) + len(medium) < budget
    requests = [(first, 30), (short, 6), (medium, 6), (long, 6)]
    answers, steps, calls = serve_gated(runtime, requests, max_batch=4, step_tokens=budget)
    alone = [runtime.generate([prompt], n, stop_at_eos=False)[0] for prompt, n in requests]
    assert [len(a) for a in answers] == [n for _, n in requests] and agreement(answers, alone) >= 0.9
    assert all(rows + sum(fills) <= budget for rows, fills in steps), steps
    together = next(fills for _, fills in steps if len(fills) == 3)  # short, medium and the long one's start
    assert together[:2] == [len(short), len(medium)] and 0 < together[2] < len(long)
    assert len(calls) == len(steps)  # a step is one forward call, whatever it carries


def test_a_full_kv_budget_makes_requests_wait_and_a_cancelled_one_frees_its_row(bf16_runtime):
    """With KV room for two requests, four never run more than two at once (they wait: no error, no refusal);
    a cancelled request's row goes to the next in line."""
    from tests.model.test_chunked_prefill import kv_wait_and_cancel

    kv_wait_and_cancel(bf16_runtime, lambda got, alone: agreement(got, alone) >= 0.9)

"""Releasing generated text safely (stop strings split across tokens, half characters) and choosing tokens."""

import numpy as np
import pytest

from serving.sampling import Sampling, choose_token
from serving.text import TextStream


class ByteTokenizer:
    """Token i is byte i: enough to split characters and stop strings across tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def released(text: str, stops: list[str]) -> tuple[list[str], str, bool]:
    stream = TextStream(ByteTokenizer(), stops)
    pieces = [stream.push(byte) for byte in text.encode()]
    if not stream.stopped:
        pieces.append(stream.finish())
    return pieces, stream.text, stream.stopped


def test_a_stop_string_split_across_tokens_is_never_released_and_ends_the_text():
    pieces, text, stopped = released("Hello END world", ["END"])
    assert text == "Hello " and stopped
    assert "".join(pieces) == "Hello " and all("E" not in piece for piece in pieces)


def test_text_held_back_as_a_possible_stop_is_released_when_it_is_not_one():
    pieces, text, stopped = released("an ENtry", ["END"])
    assert text == "an ENtry" and not stopped
    assert pieces[3:5] == ["", ""]  # "E", "N" waited until "t" showed they do not start "END"


def test_half_a_multibyte_character_is_never_released():
    pieces, text, _ = released("né", [])
    assert pieces == ["n", "", "é", ""] and text == "né"


def test_the_earliest_of_several_stops_wins():
    assert released("a;b.c", [".", ";"])[1] == "a"


def test_greedy_picks_the_argmax_and_top_k_1_leaves_only_it_to_sample():
    logits = np.array([0.1, 2.0, 1.9, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert choose_token(logits, Sampling(), rng) == 1
    assert {choose_token(logits, Sampling(temperature=5.0, top_k=1), rng) for _ in range(20)} == {1}


def test_top_p_samples_only_from_the_smallest_head_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = [choose_token(logits, Sampling(temperature=1.0, top_p=0.75), rng) for _ in range(400)]
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reaches 0.75; 2 and 3 are cut
    assert np.mean(np.array(draws) == 0) == pytest.approx(0.5 / 0.8, abs=0.08)


def test_the_same_seed_draws_the_same_tokens():
    logits = np.zeros(50, dtype=np.float32)

    def draws(seed):
        rng = np.random.default_rng(seed)
        return [choose_token(logits, Sampling(temperature=1.0, seed=seed), rng) for _ in range(10)]

    assert draws(7) == draws(7) and draws(7) != draws(8)


def test_chat_on_a_model_without_a_chat_template_is_a_400_naming_the_alternative():
    from serving.text import RequestError, chat_prompt

    with pytest.raises(RequestError, match="no chat template; use /v1/completions") as error:
        chat_prompt(ByteTokenizer(), [{"role": "user", "content": "hi"}])
    assert error.value.status == 400


def test_repetition_penalty_is_transformers_rule_and_openai_penalties_count_the_answer():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from serving.sampling import adjusted_logits

    rng = np.random.default_rng(1)
    logits = rng.normal(size=50).astype(np.float32)
    prompt, generated = [3, 7, 7, 11], [11, 20, 20, 20]
    ours = adjusted_logits(logits, Sampling(repetition_penalty=1.3), prompt, generated, frozenset())
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([prompt + generated]), torch.tensor(logits[None].copy())
    )[0].numpy()
    assert np.allclose(ours, theirs, atol=1e-6)
    openai_rule = adjusted_logits(
        logits, Sampling(frequency_penalty=0.5, presence_penalty=0.25), prompt, generated, frozenset()
    )
    expected = logits.astype(np.float64).copy()
    expected[11] -= 0.5 * 1 + 0.25
    expected[20] -= 0.5 * 3 + 0.25  # the prompt's tokens (3, 7) are not penalised by OpenAI's rule
    assert np.allclose(openai_rule, expected)
    assert adjusted_logits(logits, Sampling(), prompt, generated, frozenset({4})) is logits  # nothing applies


def test_min_tokens_bars_the_stop_tokens_until_enough_were_generated():
    from serving.sampling import adjusted_logits

    logits = np.array([0.0, 5.0, 1.0], dtype=np.float32)  # token 1 (the stop token) is the argmax
    barred = adjusted_logits(logits, Sampling(min_tokens=2), [0], [2], frozenset({1}))
    assert choose_token(barred, Sampling(), np.random.default_rng(0)) == 2
    allowed = adjusted_logits(logits, Sampling(min_tokens=2), [0], [2, 2], frozenset({1}))
    assert choose_token(allowed, Sampling(), np.random.default_rng(0)) == 1


def test_typical_p_draws_only_from_the_set_transformers_typical_warper_keeps():
    import torch
    from transformers import TypicalLogitsWarper

    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    warped = TypicalLogitsWarper(mass=0.6)(torch.zeros(1, 1, dtype=torch.long), torch.tensor(logits[None]))
    kept = {int(i) for i in torch.nonzero(torch.isfinite(warped[0])).flatten()}
    rng = np.random.default_rng(0)
    draws = {choose_token(logits, Sampling(temperature=1.0, typical_p=0.6), rng) for _ in range(300)}
    assert draws == kept and len(kept) < len(logits)


def test_tgi_frequency_penalty_is_each_tokens_share_of_the_whole_sequence():
    from serving.sampling import adjusted_logits

    logits = np.zeros(10)
    out = adjusted_logits(
        logits, Sampling(frequency_penalty=1.0, frequency_share=True), [3, 3], [5, 3], frozenset()
    )
    assert out[3] == -0.75 and out[5] == -0.25 and out[0] == 0.0  # 3 of 4 tokens are 3, 1 of 4 is 5


class _EosFirst:
    """A runtime whose every next-token distribution puts the end-of-sequence token (0) first, token 1 second."""

    def batch_decoder(self):
        from tasks.engines.contract import BatchDecoder

        class Decoder(BatchDecoder):
            def __init__(self):
                self.sequences = set()

            def add(self, prompt):
                self.sequences.add(len(self.sequences) + 1)
                return max(self.sequences), np.array([5.0, 4.0, 0.0], dtype=np.float32)

            def step(self, tokens):
                return {s: np.array([5.0, 4.0, 0.0], dtype=np.float32) for s in tokens}

            def remove(self, sequence):
                self.sequences.discard(sequence)

            @property
            def active(self):
                return len(self.sequences)

        return Decoder()


@pytest.mark.parametrize(
    "options, expected",
    [({}, [0]), ({"min_tokens": 3}, [1, 1, 1, 0]), ({"ignore_eos": True}, [0, 0, 0, 0, 0])],
)
def test_min_tokens_and_ignore_eos_each_keep_a_request_going_past_the_end_token(options, expected):
    import threading

    from serving.scheduler import GenerationRequest, Scheduler

    scheduler = Scheduler(_EosFirst(), max_batch=2, max_queue=2)
    tokens, done = [], threading.Event()

    def on_event(event):
        if event[0] == "token":
            tokens.append(event[1][0])
        else:
            done.set()

    stops = frozenset() if options.get("ignore_eos") else frozenset({0})
    sampling = Sampling(min_tokens=options.get("min_tokens", 0))
    scheduler.submit(GenerationRequest([7, 8], 5, sampling, on_event, stop_ids=stops))
    assert done.wait(10)
    scheduler.close()
    assert tokens == expected

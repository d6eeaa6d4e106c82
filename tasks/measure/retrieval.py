"""retrieval: the planted-fact check at long context, through the variant's own Runtime.

Protocol (RULER's "needle in a haystack" sentence, which SmolLM2-135M answers where a pass-key phrasing misled it):
in a document's first tokens, at `depth` of the haystack, the needle " One of the special magic numbers for <word>
is: <key>. " is planted, and the window ends with the question "What is the special magic number for <word>
mentioned in the provided text? The special magic number for <word> mentioned in the provided text is". The answer
is read greedily (the key's tokens and EXTRA_TOKENS more; with it the window is exactly `length` tokens) and is
correct when its first number is the key. Keys and words are drawn from the seed, the document's name and the
length, so every variant answers the same questions. The depths of one document and length share the haystack
before the shallowest needle: the engine's sequence is rewound there, not refilled.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tasks.config import LongContextConfig
from tasks.engines import Runtime
from tasks.errors import DataValidationError
from tasks.measure.long_context import feed

WORDS = [
    "apple",
    "anchor",
    "badger",
    "candle",
    "cedar",
    "copper",
    "falcon",
    "garnet",
    "harbor",
    "island",
    "jasper",
    "kettle",
    "lantern",
    "maple",
    "meadow",
    "nickel",
    "orchard",
    "otter",
    "pepper",
    "quartz",
    "raven",
    "saddle",
    "salmon",
    "thistle",
    "timber",
    "velvet",
    "walnut",
    "willow",
    "zephyr",
    "marble",
]
NEEDLE = " One of the special magic numbers for {word} is: {key}. "
QUESTION = (
    "\n\nWhat is the special magic number for {word} mentioned in the provided text? "
    "The special magic number for {word} mentioned in the provided text is"
)
EXTRA_TOKENS = 3  # read past the key's own tokens: a longer number is wrong, not right


@dataclass(frozen=True)
class Trial:
    """One planted fact: `key` about `word` at `depth` of the haystack."""

    depth: float
    word: str
    key: str


@dataclass(frozen=True)
class RetrievalResult:
    """The trials at one length, in (document, depth) order: the same order for every variant."""

    depths: list[float]
    correct: list[bool]
    answers: list[str]  # what the variant said (the report shows misses)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0


def trials(name: str, length: int, cfg: LongContextConfig) -> list[Trial]:
    """The facts planted in document `name` at `length`, shallowest first."""
    rng = random.Random(f"{cfg.seed}\0{name}\0{length}")
    digits = cfg.retrieval.key_digits
    return [
        Trial(
            depth, rng.choice(WORDS), str(rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits))
        )
        for depth in cfg.retrieval.depths
    ]


def answer_tokens(runtime: Runtime, trial: Trial) -> int:
    """Tokens read for an answer: the key's own and EXTRA_TOKENS more."""
    return len(runtime.encode(" " + trial.key)) + EXTRA_TOKENS


def planted(runtime: Runtime, ids: list[int], length: int, trial: Trial) -> tuple[list[int], list[int]]:
    """(haystack before the needle, needle + haystack after it + question): with the answer read after them,
    `length` tokens in all (so a window of the model's positions holds the answer too)."""
    needle = runtime.encode(NEEDLE.format(word=trial.word, key=trial.key))
    question = runtime.encode(QUESTION.format(word=trial.word))
    room = length - len(needle) - len(question) - answer_tokens(runtime, trial)
    if room < 1:
        raise DataValidationError(
            f"long_context.retrieval.lengths: {length} tokens cannot hold the question and its fact"
        )
    at = round(trial.depth * room)
    return ids[:at], needle + ids[at:room] + question


def correct(answer: str, key: str) -> bool:
    """The answer's first number is the key."""
    number = re.search(r"\d+", answer)
    return number is not None and number.group() == key


def _greedy(sequence, tokens: list[int], count: int) -> list[int]:
    feed(sequence, tokens[:-1])
    logits, out = sequence.extend(tokens[-1:], every=False), []
    while True:
        out.append(int(np.argmax(logits[-1])))
        if len(out) == count:
            return out
        logits = sequence.extend(out[-1:], every=False)


def answer_document(runtime: Runtime, ids: list[int], length: int, facts: list[Trial]) -> list[str]:
    """Each fact's greedy answer in one engine sequence: the haystack up to the next needle is appended, the rest
    asked and answered, the sequence rewound to before that needle (a cache that cannot rewind, such as a sliding
    window past its size or a quantized one, starts a fresh sequence per fact)."""
    sequence, answers, held = runtime.sequence(length), [], 0
    rewinds = getattr(sequence, "rewinds", True)
    for fact in facts:
        before, after = planted(runtime, ids, length, fact)
        if sequence.length and not rewinds:
            sequence, held = runtime.sequence(length), 0
        elif len(before) < held:  # the needle sits before what is held (a longer key or word left less room)
            sequence.rewind(len(before))
            held = len(before)
        feed(sequence, before[held:])
        held = len(before)
        answers.append(runtime.decode(_greedy(sequence, after, answer_tokens(runtime, fact))))
        if rewinds:
            sequence.rewind(held)
    return answers


def retrieval(
    runtime: Runtime,
    documents: list[tuple[str, str]],
    cfg: LongContextConfig,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, RetrievalResult]:
    """Per length of `cfg.retrieval_lengths`: every document's facts, answered."""
    chosen = documents[: cfg.retrieval.documents or len(documents)]
    encoded = [(name, runtime.encode(text)) for name, text in chosen]
    lengths = cfg.retrieval_lengths
    if max(lengths) > runtime.context_length:
        raise DataValidationError(
            f"long_context.retrieval.lengths: {max(lengths)} tokens, the model takes {runtime.context_length} positions"
        )
    results, done = {}, 0
    for length in lengths:
        depths, hits, answers = [], [], []
        for name, ids in encoded:
            if len(ids) < length:
                raise DataValidationError(
                    f"long_context: document {name!r} has {len(ids)} tokens, under {length}"
                )
            facts = trials(name, length, cfg)
            said = answer_document(runtime, ids, length, facts)
            depths += [fact.depth for fact in facts]
            hits += [correct(text, fact.key) for text, fact in zip(said, facts, strict=True)]
            answers += said
            done += 1
            if progress:
                progress(done, len(encoded) * len(lengths))
        results[length] = RetrievalResult(depths, hits, answers)
    return results

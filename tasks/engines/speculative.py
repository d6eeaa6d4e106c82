"""Speculative decoding: a cheap proposer guesses the next few tokens, the variant's own engine checks them all in
one call, and only the tokens the variant would have chosen itself are kept.

The verify loop works on any engine that can hold one sequence's KV cache, run several new tokens after it in one
call with the logits of each, and rewind the cache to a shorter length (`Runtime.sequence`): llama.cpp (several
positions of one sequence in one `llama_decode`, cells removed on rewind), ONNX Runtime GenAI (`append_tokens` of
several tokens, `rewind_to`) and PyTorch (a dynamic cache, cropped).

Greedy: a proposal is kept while it equals the arg-max of the variant's logits at its position; the first
disagreement is replaced by that arg-max, and when every proposal is kept, the logits after the last one give a
bonus token. Where an engine computes k rows exactly as it computes one (llama.cpp, PyTorch on the CPU) the output
is the variant's greedy output token for token; where its kernels differ by shape (ONNX Runtime's int4 MatMulNBits)
near-ties can go the other way, so the benchmark measures the agreement instead of assuming it.

Sampled: the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): a proposal drawn from q is kept
with probability min(1, p/q), else a token is drawn from max(p - q, 0) renormalised; the result is distributed as
p, the variant's own distribution. llmopt's proposers are deterministic (q is one-hot on the proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tasks.engines.contract import common_prefix

if TYPE_CHECKING:
    from tasks.config import SpeculativeSettings
    from tasks.engines.contract import Runtime

DRAFT_FOLDER = "draft"  # a `draft` variant's proposer, built into its folder (its own manifest and tokenizer)


class Sequence(Protocol):
    """One sequence's KV cache in an engine."""

    def extend(self, tokens: list[int], every: bool = True) -> np.ndarray:
        """Run `tokens` after what the cache holds (they join it); float32 logits [len(tokens), vocabulary], or
        [1, vocabulary] after the last token only (`every` off: a prompt, where the others are never read)."""

    def rewind(self, length: int) -> None:
        """Keep only the cache's first `length` tokens."""

    # Whether `rewind` can work (an attribute; absent: True): False for a cache that forgets, such as a sliding
    # window once it is full
    rewinds: bool


@dataclass
class Stats:
    """What speculation did over some generations (the benchmark reports these next to the speed-up)."""

    calls: int = 0  # verify calls: engine calls on the variant after each prompt's own call
    proposed: int = 0  # tokens the proposer guessed
    accepted: int = 0  # ... and the variant kept
    generated: int = 0  # tokens generated (each prompt's first token comes from the prompt's call)

    @property
    def acceptance(self) -> float:
        """Share of proposed tokens kept."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Tokens generated per engine call of the variant after the prompt's (1.0: no gain over plain decoding)."""
        return self.accepted / self.calls + 1 if self.calls else 1.0

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "generated": self.generated,
            "acceptance": round(self.acceptance, 4),
            "tokens_per_call": round(self.tokens_per_call, 4),
        }


def ngram_proposal(context: list[int], limit: int, ngram_size: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last `ngram_size`
    tokens (then `ngram_size - 1`, ... down to 2, or 1 when `ngram_size` is 1), at most `limit` of them; [] when
    nothing matches. A single token repeats by chance in free text: on SmolLM2 in llama.cpp, guesses from 1-token
    matches were kept 11-17 % of the time and made decoding 20-30 % slower, from 2-token matches 33-38 %."""
    if limit <= 0:
        return []
    array = np.asarray(context, dtype=np.int64)
    shortest = min(2, ngram_size)
    for size in range(min(ngram_size, len(context) - 1), shortest - 1, -1):
        tail = array[-size:]
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], size)  # starts 0 .. len - 1 - size
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + size
            return context[start : start + limit]
    return []


class NgramProposer:
    def __init__(self, ngram_size: int) -> None:
        self.ngram_size = ngram_size

    def reset(self, capacity: int) -> None:
        return None

    def propose(self, context: list[int], limit: int) -> list[int]:
        return ngram_proposal(context, limit, self.ngram_size)


class DraftProposer:
    """Another variant (same tokenizer) guesses greedily. Its cache keeps the longest start of the context it has
    seen, so after a verify step it runs only the tokens that changed, then one call per guessed token."""

    def __init__(self, draft: Runtime) -> None:
        self.draft = draft
        self._sequence: Sequence | None = None
        self._held: list[int] = []

    def reset(self, capacity: int) -> None:
        self._sequence, self._held = self.draft.sequence(capacity), []

    def propose(self, context: list[int], limit: int) -> list[int]:
        if self._sequence is None:
            raise RuntimeError("DraftProposer.reset must come before propose")
        if limit <= 0:
            return []
        shared = common_prefix(self._held, context, limit=len(context) - 1)
        self._sequence.rewind(shared)
        logits = self._sequence.extend(context[shared:], every=False)[-1]
        guesses = [int(np.argmax(logits))]
        while len(guesses) < limit:
            guesses.append(int(np.argmax(self._sequence.extend(guesses[-1:], every=False)[-1])))
        self._held = context + guesses[:-1]
        return guesses


@dataclass
class Greedy:
    """Keep a proposal while it is the arg-max (of the tokens not `suppressed`: the end-of-sequence ids where the
    engine's plain decoding runs to length without them, so that speculation gives its tokens)."""

    suppressed: frozenset[int] = frozenset()

    def first(self, logits: np.ndarray) -> int:
        if self.suppressed:
            logits = np.array(logits, dtype=np.float32)
            logits[list(self.suppressed)] = -np.inf
        return int(np.argmax(logits))

    def check(self, logits: np.ndarray, proposal: int) -> tuple[bool, int]:
        best = self.first(logits)
        return best == proposal, best


@dataclass
class Sampling:
    """Sample from softmax(logits / temperature), keeping proposals by the rejection rule."""

    temperature: float = 1.0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        scaled = np.asarray(logits, dtype=np.float64) / self.temperature
        weights = np.exp(scaled - scaled.max())
        return weights / weights.sum()

    def first(self, logits: np.ndarray) -> int:
        p = self.probabilities(logits)
        return int(self.rng.choice(len(p), p=p))

    def check(self, logits: np.ndarray, proposal: int) -> tuple[bool, int]:
        return accept_or_resample(self.probabilities(logits), proposal, self.rng)


def accept_or_resample(
    p: np.ndarray, proposal: int, rng: np.random.Generator, q: np.ndarray | None = None
) -> tuple[bool, int]:
    """The rejection rule for a proposal drawn from `q` (None: a deterministic proposer, q one-hot on it) when
    the variant's distribution is `p`: (kept?, the token to emit). Emitted tokens are distributed as `p`."""
    q_token = 1.0 if q is None else float(q[proposal])
    if rng.random() * q_token < p[proposal]:  # probability min(1, p / q)
        return True, proposal
    if q is None:
        residual = np.array(p, dtype=np.float64)
        residual[proposal] = 0.0
    else:
        residual = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q: the proposal is always kept above; reached only through rounding
        return True, proposal
    return False, int(rng.choice(len(p), p=residual / total))


def speculative_decode(
    sequence: Sequence,
    proposer: NgramProposer | DraftProposer,
    prompt: list[int],
    max_new_tokens: int,
    tokens: int,
    pick: Greedy | Sampling,
    eos: int | None = None,
    stats: Stats | None = None,
) -> list[int]:
    """The continuation of `prompt` (at most `max_new_tokens`, ending at `eos` when given), proposing up to
    `tokens` tokens per verify call of `sequence` (a fresh cache of the variant)."""
    stats = stats if stats is not None else Stats()
    token = pick.first(sequence.extend(prompt, every=False)[-1])
    out: list[int] = []
    while True:
        out.append(token)
        if len(out) >= max_new_tokens or token == eos:
            break
        guesses = proposer.propose(prompt + out, min(tokens, max_new_tokens - len(out)))
        rows = sequence.extend([token, *guesses])  # the cache now holds prompt + out + guesses
        stats.calls, stats.proposed = stats.calls + 1, stats.proposed + len(guesses)
        kept = 0
        for row, guess in zip(rows, guesses, strict=False):
            agreed, token = pick.check(row, guess)
            if not agreed:
                break
            kept += 1
            out.append(guess)
            if guess == eos:
                break
        else:
            token = pick.first(rows[len(guesses)])
        stats.accepted += kept
        if out[-1] == eos or len(out) >= max_new_tokens:
            break
        sequence.rewind(len(prompt) + len(out))
    stats.generated += len(out)
    return out


class Speculation:
    """A variant's speculative decoding: its settings, its proposer and what it did so far. `enabled` off makes
    the runtime decode plainly (the benchmark times both on the same prompts)."""

    def __init__(self, settings: SpeculativeSettings, draft: Runtime | None = None) -> None:
        self.settings, self.draft = settings, draft
        self.stats = Stats()
        self.enabled = True

    def fits(self, capacity: int) -> bool:
        """Whether the proposer can hold a sequence of `capacity` tokens (a draft has its own context length)."""
        return self.draft is None or capacity <= self.draft.context_length

    def proposer(self, capacity: int) -> NgramProposer | DraftProposer:
        """A proposer of its own for one sequence of at most `capacity` tokens (the server's requests)."""
        proposer = (
            DraftProposer(self.draft) if self.draft is not None else NgramProposer(self.settings.ngram_size)
        )
        proposer.reset(capacity)
        return proposer

    def generate(
        self, runtime: Runtime, prompt: list[int], max_new_tokens: int, stop_at_eos: bool
    ) -> list[int]:
        """The greedy continuation of one prompt, speculatively: the tokens `runtime._generate_batch` gives
        where the engine's k-token calls compute what its one-token calls do."""
        # the verify loop never holds more than the prompt and the budget (guesses stop at it)
        capacity = len(prompt) + max_new_tokens
        return speculative_decode(
            runtime.sequence(capacity),
            self.proposer(capacity),
            prompt,
            max_new_tokens,
            self.settings.tokens,
            Greedy(runtime.suppressed_at_length(stop_at_eos)),
            runtime.eos_token_id if stop_at_eos else None,
            self.stats,
        )

"""How the server picks each token and what it reports of the model's probabilities: a request's `Sampling`
settings, the logits after penalties and the EOS floor (`adjusted_logits`), the draw (`choose_token`: greedy, or
temperature with top-k, top-p and typical-p cuts), and log-probabilities (`logprob`, `top_logprobs`,
`prompt_scores`), always the model's own, before temperature and penalties. Pure numpy; the scheduler calls it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """How a request picks its next token: temperature 0 is greedy (argmax, ties to the lowest id). Penalties and
    the EOS floor change the logits the choice is made from (greedy too); reported log-probabilities stay the
    model's own."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    typical_p: float = 1.0  # locally typical sampling (TGI's typical_p); 1: off
    repetition_penalty: float = 1.0  # transformers'/TGI's: logits of tokens seen (prompt included) /p or *p
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often a token was generated
    # TGI's frequency penalty instead: minus it times each token's share of the whole sequence (prompt included)
    frequency_share: bool = False
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token was generated
    min_tokens: int = 0  # stop tokens are not chosen before this many tokens
    top_logprobs: int = 0  # the n most likely tokens' log-probabilities sent with each token


GREEDY_BELOW = 1e-5  # a temperature this small samples the argmax anyway; dividing by it would overflow


def adjusted_logits(
    logits: np.ndarray, sampling: Sampling, prompt: list[int], generated: list[int], stop_ids: frozenset[int]
) -> np.ndarray:
    """The logits a token is chosen from: repetition penalty over prompt and answer (transformers' rule: positive
    logits divided, negative multiplied), OpenAI's frequency and presence penalties over the answer, and stop
    tokens barred until `min_tokens` were generated. Unchanged (the same array) when nothing applies."""
    penalised = sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty
    floor = len(generated) < sampling.min_tokens and stop_ids
    if not penalised and not floor:
        return logits
    out = logits.astype(np.float64)
    if sampling.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt + generated, dtype=np.int64))
        values = out[seen]
        out[seen] = np.where(
            values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty
        )
    if sampling.frequency_share and sampling.frequency_penalty:
        sequence = prompt + generated
        ids, counts = np.unique(np.asarray(sequence, dtype=np.int64), return_counts=True)
        out[ids] -= sampling.frequency_penalty * counts / len(sequence)
    elif generated and (sampling.frequency_penalty or sampling.presence_penalty):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        out[ids] -= sampling.frequency_penalty * counts + sampling.presence_penalty
    if floor:
        out[list(stop_ids)] = -np.inf
    return out


def choose_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from one sequence's logits: argmax when greedy, else a draw after temperature, top-k,
    nucleus (top-p) and typical-p cuts."""
    if sampling.temperature < GREEDY_BELOW:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / sampling.temperature
    order = np.argsort(-scaled, kind="stable")
    if sampling.top_k:
        order = order[: sampling.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if sampling.top_p < 1.0:  # the smallest head whose mass reaches top_p (always at least one token)
        keep = int(np.searchsorted(np.cumsum(probs), sampling.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    if sampling.typical_p < 1.0:  # the tokens closest to the entropy until their mass reaches typical_p
        with np.errstate(divide="ignore", invalid="ignore"):
            surprise = -np.log(probs)
            entropy = float(np.nansum(probs * np.where(probs > 0, surprise, 0.0)))
        by_typicality = np.argsort(np.abs(surprise - entropy), kind="stable")
        keep = int(np.searchsorted(np.cumsum(probs[by_typicality]), sampling.typical_p)) + 1
        chosen = by_typicality[:keep]
        order, probs = order[chosen], probs[chosen] / probs[chosen].sum()
    if not np.isfinite(probs).all():  # logits the engine returned as inf/nan: nothing sensible to draw from
        raise ValueError("the model's logits are not finite")
    return int(order[rng.choice(len(order), p=probs)])


def logprob(logits: np.ndarray, token: int) -> float:
    """The model's log-probability of `token` (before any temperature), as TGI's and OpenAI's answers report it."""
    peak = logits.max()
    return float(logits[token] - peak - np.log(np.exp(logits - peak).sum()))


def top_logprobs(logits: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The `n` most likely tokens and their log-probabilities under the model, most likely first (a partial
    sort: the worker thread does this for every token of every request that asks)."""
    peak = logits.max()
    total = peak + np.log(np.exp(logits - peak).sum())
    best = _largest(logits, n)
    return [(int(token), float(logits[token] - total)) for token in best]


def _largest(logits: np.ndarray, n: int) -> np.ndarray:
    """Indices of the `n` largest values of a 1-d array, largest first (ties: lower index first)."""
    n = min(n, len(logits))
    head = np.argpartition(-logits, n - 1)[:n] if n < len(logits) else np.arange(len(logits))
    return head[np.lexsort((head, -logits[head]))]


def prompt_scores(
    logits: np.ndarray, prompt: list[int], top: int
) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """Each prompt token with its log-probability given the tokens before it (None for the first, which has no
    context) and, when asked, the `top` most likely tokens at its position; one matrix pass over the rows."""
    rows = np.asarray(logits[: len(prompt) - 1], dtype=np.float64)
    peak = rows.max(axis=-1, keepdims=True)
    log_probs = rows - (peak + np.log(np.exp(rows - peak).sum(axis=-1, keepdims=True)))
    targets = np.asarray(prompt[1:], dtype=np.int64)
    chosen = log_probs[np.arange(len(targets)), targets]
    scores: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(prompt[0], None, None)]
    argmax = log_probs.argmax(axis=-1) if top == 1 else None  # what harnesses ask (is the text greedy?)
    for position, token in enumerate(prompt[1:]):
        if top:
            best = (
                argmax[position : position + 1] if argmax is not None else _largest(log_probs[position], top)
            )
            head = [(int(t), float(log_probs[position, t])) for t in best]
        else:
            head = None
        scores.append((token, float(chosen[position]), head))
    return scores

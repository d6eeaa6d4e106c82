"""The recipe search's cheap first look at a built candidate, before any race: its stored bytes, how far its
next-token distributions are from the baseline's on a few calibration windows (KL divergence), and one short decode
timing. The proxies only order and screen candidates; nothing is promoted on them (the race and its confirmation
decide), so they can be cheap and rough.

KL(baseline ‖ candidate), in nats per predicted token, would be what a candidate adds to the baseline's
cross-entropy if the baseline's distribution were the text's. It is not, and KL counts every change of the
distribution while the perplexity ratio lets errors on the text's tokens cancel: on SmolLM2-135M (8 calibration
windows of 256 tokens against the pipeline's paired perplexity ratios) KL matched ln(ratio) where perplexity
barely moved (0.0048 vs 0.0051 for ONNX int8, 0.0033 vs 0.0037 for the shipped Q4_1 GGUF) and was 5-7 times it
where it moved 2-2.6 % (0.142 vs 0.021 for ONNX int4 mixed, 0.134 vs 0.026 for llama.cpp Q4_0 mixed). So `screen`
drops a candidate only past `kl_margin` (15) × ln(1 + max_ppl_increase): twice the KL that a recipe at the edge of
the budget would show if it ran 7 times its ln(ratio) as those did.
Every engine gives per-position logits (`Runtime.position_logits`), so the proxy is the same for all of them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Proxy:
    """One candidate's cheap look."""

    candidate: str
    stored_bytes: int
    kl: float  # mean KL(baseline ‖ candidate) per predicted token, nats, over the proxy windows
    kl_windows: tuple[float, ...]  # per window, for a paired reading later
    decode_tok_s: float  # one short decode at batch 1 (after one warm-up call)


def log_probs(runtime: Any, windows: list[list[int]]) -> list[np.ndarray]:
    """The runtime's next-token log-probabilities at every position of each window (float32, length × vocab): the
    baseline's, computed once per search and compared with every candidate's."""
    return [_log_softmax(np.asarray(runtime.position_logits(ids), dtype=np.float32)) for ids in windows]


def kl_to_reference(reference: list[np.ndarray], runtime: Any, windows: list[list[int]]) -> tuple[float, ...]:
    """Per window, the mean over its positions of KL(reference ‖ runtime's distribution), nats. The vocabularies
    must be the same (a candidate of the same model)."""
    if len(reference) != len(windows):
        raise ValueError("one reference per window")
    result = []
    for expected, ids in zip(reference, windows, strict=True):
        got = _log_softmax(np.asarray(runtime.position_logits(ids), dtype=np.float32))
        if got.shape != expected.shape:
            raise ValueError(f"logits of shape {got.shape}, the reference's are {expected.shape}")
        per_position = (np.exp(expected) * (expected - got)).sum(-1)
        result.append(
            float(np.maximum(per_position, 0.0).mean())
        )  # rounding makes a tiny KL slightly negative
    return tuple(result)


def short_decode_tok_s(runtime: Any, prompt: list[int], new_tokens: int = 16) -> float:
    """Decode tokens per second of one greedy call of `new_tokens` after `prompt`, batch 1, after a one-token warm-up
    call: after the first token where the engine reports when it came (`Runtime.first_token_s`, as the benchmark
    reads decode speed), else the whole call's rate. One run: a rough figure, for ordering candidates."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2")
    runtime.generate([prompt], 1, stop_at_eos=False)
    return timed_decode(runtime, prompt, new_tokens)


def timed_decode(runtime: Any, prompt: list[int], new_tokens: int) -> float:
    """One timed greedy call: decode tok/s after the first token where the engine says when it came (a runtime in
    a process of its own times it there: `IsolatedRuntime.timed_decode`)."""
    own = getattr(runtime, "timed_decode", None)
    if own is not None:
        return own(prompt, new_tokens)
    started = time.perf_counter()
    runtime.generate([prompt], new_tokens, stop_at_eos=False)
    total = time.perf_counter() - started
    first = getattr(runtime, "first_token_s", None)
    if first is None or not 0 < first < total:
        return new_tokens / total
    return (new_tokens - 1) / (total - first)


def proxy(
    candidate: str,
    stored_bytes: int,
    runtime: Any,
    reference: list[np.ndarray],
    windows: list[list[int]],
    prompt: list[int],
    new_tokens: int = 16,
) -> Proxy:
    """A loaded candidate's proxies (`stored_bytes`: its artifact on disk, as the manifest counts it)."""
    kl = kl_to_reference(reference, runtime, windows)
    speed = short_decode_tok_s(runtime, prompt, new_tokens)
    return Proxy(candidate, stored_bytes, float(np.mean(kl)), kl, speed)


@dataclass(frozen=True)
class Screened:
    """The candidates worth racing, best first, and the ones left out with why."""

    kept: list[str]
    dropped: dict[str, str]


def screen(proxies: list[Proxy], keep: int, max_ppl_increase: float, kl_margin: float = 15.0) -> Screened:
    """Drop a candidate whose KL is above `kl_margin` × ln(1 + max_ppl_increase) (far outside the accuracy
    budget); keep the `keep` fastest of the rest, fastest first. KL is no ranking of accuracy across methods (a
    mixed-precision plan minimises the text's loss, not the distance to the baseline's distribution: on the
    default model llama.cpp IQ4_XS with an importance matrix read KL 0.117 and perplexity ×1.092 where llmopt's
    Q4_0 mixed read KL 0.146 and ×1.026), so no candidate is dropped for being further on KL than a faster one."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    limit = kl_margin * math.log1p(max_ppl_increase)
    dropped = {
        p.candidate: f"KL {p.kl:.4f} nats/token > {limit:.4f} ({kl_margin:g} × ln(1 + {max_ppl_increase:g}))"
        for p in proxies
        if p.kl > limit
    }
    ranked = sorted((p for p in proxies if p.candidate not in dropped), key=lambda p: -p.decode_tok_s)
    for p in ranked[keep:]:
        dropped[p.candidate] = f"not among the {keep} fastest of the screened candidates"
    return Screened([p.candidate for p in ranked[:keep]], dropped)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

"""long_context: accuracy at long context, through the variant's own Runtime.

Protocol: each document is tokenized whole (no special tokens); its first max(`lengths`) tokens are kept and the
last `tail_tokens` of them are the tail, the same tokens at every length. At a length L the window is the L tokens
that end with the tail: L - tail_tokens tokens of the same document's context before it. The tail's negative
log-likelihood is summed (each tail token predicted from everything before it in the window); perplexity at L =
exp(total NLL / total tail tokens) over the documents, and the per-document sums pair with the baseline's like the
short-context windows do (tasks/measure/evaluate.py keeps them as a `PerplexityResult` a length). The context goes through the engine's incremental sequence in slices
without its logits; only the tail's rows of logits are kept (an 8 k-token window's full logits would be ~1.6 GB).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.config import LongContextConfig
from tasks.engines import Runtime
from tasks.errors import DataValidationError
from tasks.measure.sampling import repeat_to_length

SLICE_TOKENS = 1024  # context tokens per engine call (bounds the activations of one call)
ROWS = 64  # tail rows of logits per log-softmax


def feed(sequence: Any, tokens: list[int]) -> None:
    """Append `tokens` to an engine's sequence in slices of SLICE_TOKENS, their logits not kept (an engine may
    compute every row's: ~200 MB a slice for a 49 k vocabulary)."""
    for start in range(0, len(tokens), SLICE_TOKENS):
        sequence.extend(tokens[start : start + SLICE_TOKENS], every=False)


def tail_windows(ids: list[int], cfg: LongContextConfig) -> dict[int, list[int]]:
    """The window at each length, all ending with the same tail: the first max(lengths) ids' last L."""
    longest = max(cfg.lengths)
    return {length: ids[longest - length : longest] for length in cfg.lengths}


def tail_nll(runtime: Runtime, window: list[int], tail: int) -> tuple[float, int]:
    """(sum of the negative log-likelihoods of the window's last `tail` tokens, `tail`), each given every token
    before it in the window."""
    context = len(window) - tail
    sequence = runtime.sequence(len(window))
    feed(sequence, window[: context - 1])
    logits = sequence.extend(window[context - 1 : -1], every=True)
    targets, total = window[context:], 0.0
    for start in range(0, tail, ROWS):  # a float64 copy of a few rows at a time, not of tail x vocabulary
        rows = np.asarray(logits[start : start + ROWS], dtype=np.float64)
        peak = rows.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
        total += float((log_norm - rows[np.arange(len(rows)), targets[start : start + ROWS]]).sum())
    return total, tail


def tail_losses(
    runtime: Runtime,
    documents: list[tuple[str, str]],
    cfg: LongContextConfig,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, tuple[list[float], list[int]]]:
    """Per length: (each document's tail NLL, each document's tail tokens)."""
    longest = max(cfg.lengths)
    if longest > runtime.context_length:
        raise DataValidationError(
            f"long_context.lengths: {longest} tokens, the model takes {runtime.context_length} positions"
        )
    windows = []
    for name, text in documents:
        ids = runtime.encode(text)
        if len(ids) < longest:
            raise DataValidationError(
                f"long_context: document {name!r} has {len(ids)} tokens, under {longest}"
            )
        windows.append(tail_windows(ids, cfg))
    results, done = {}, 0
    for length in cfg.lengths:
        nll, counts = [], []
        for window in windows:
            loss, count = tail_nll(runtime, window[length], cfg.tail_tokens)
            nll.append(loss)
            counts.append(count)
            done += 1
            if progress:
                progress(done, len(windows) * len(cfg.lengths))
        results[length] = (nll, counts)
    return results


SPEED_TOKENS = 16  # tokens decoded at the end of each long window


@dataclass(frozen=True)
class LengthSpeed:
    """One window of `length` tokens at batch 1 (`benchmark.long_prompt_tokens`): a prompt of `length` - SPEED_TOKENS
    tokens and SPEED_TOKENS decoded after it, measured once."""

    length: int
    ttft_ms: float  # the prompt fed in slices of SLICE_TOKENS, to its first token
    decode_tok_s: float  # the SPEED_TOKENS tokens after it
    kv_bytes: (
        int | None
    )  # the KV cache holding the whole window, as the engine holds it (None: it does not say)
    peak_rss_mb: float  # the measuring process's peak resident memory during this window


def speed_at_lengths(
    runtime: Runtime,
    ids: list[int],
    lengths: list[int],
    peak_rss_mb: Callable[[], float],
    reset_peak: Callable[[], None] = lambda: None,
) -> list[LengthSpeed]:
    """Each length in turn, shortest first, through the engine's incremental sequence (the prompt in the slices a
    chunked prefill would take; an ONNX graph's every-row logits then stay ~200 MB, not ~1.6 GB at 8 k). A window
    of the model's positions fits: the decoded tokens are part of it. `reset_peak` before each window, so
    `peak_rss_mb` after it is that window's."""
    results = []
    for length in sorted(lengths):
        if length > runtime.context_length or length <= SPEED_TOKENS:
            raise DataValidationError(
                f"benchmark.long_prompt_tokens: {length} tokens, the model takes {runtime.context_length} positions"
                f" (and a window holds the {SPEED_TOKENS} tokens decoded at its end)"
            )
        prompt, sequence = repeat_to_length(ids, length - SPEED_TOKENS), runtime.sequence(length)
        reset_peak()
        start = time.perf_counter()
        feed(sequence, prompt[:-1])
        token = int(np.argmax(sequence.extend(prompt[-1:], every=False)[-1]))
        ttft_s, started = time.perf_counter() - start, time.perf_counter()
        for _ in range(SPEED_TOKENS):
            token = int(np.argmax(sequence.extend([token], every=False)[-1]))
        decode_s = time.perf_counter() - started
        kv_bytes = sequence.kv_bytes() if hasattr(sequence, "kv_bytes") else None
        results.append(LengthSpeed(length, ttft_s * 1000, SPEED_TOKENS / decode_s, kv_bytes, peak_rss_mb()))
        del sequence
    return results

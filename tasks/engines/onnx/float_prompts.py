"""From which length a prompt slice of the ONNX engine runs with float activations, measured on this CPU.

The builder's int4/int8 graph for a CPU (MatMulNBits at `accuracy_level: 4`) rounds activations to int8 inside its
matrix products. Whether that pays depends on the CPU's kernels and on how many tokens a call carries: on a Xeon
with AVX-512 VNNI (2 threads, SmolLM2-135M int4) ONNX Runtime's float kernels for the same weights
(`mlas.qnbit.force_fp32`) took 1.3-2.3x as long below 16 tokens, as long at 32, 0.85x at 64 and 0.71x at 256
(docs/results/2026-12-05-serving.md); on an AMD EPYC with AVX2 and no VNNI they took 2.1x as long at one token,
1.07x at 48 and 0.98-1.01x from 96 to 200 (docs/results/2026-12-07-serving-avx2.md): no length where they pay there,
and their session's second packed copy of the weights is memory for nothing. So the server's decoder measures
once, at its first decoder, and keeps the float session only from the shortest length where it is faster at that
length and every longer one probed (`measured_float_from`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
clock = time.perf_counter  # what the probe times both paths with (tests drive their own)

# A decoder made before the decision (or without a runtime to make it) runs slices of this many tokens or more
# with float activations: the Xeon's crossing point above.
FLOAT_PROMPT_TOKENS = 48
# the lengths probed, longest first: the probe stops at the first where float activations do not pay
PROBE_LENGTHS = (128, 96, 64, 48, 32, 24, 16)
# the best of this many calls each, the two paths' order alternating (other processes may be busy)
PROBE_ROUNDS = 3
# no shorter length is probed once this much is spent (a large model's calls take seconds)
PROBE_SECONDS = 10.0
# a model whose longest probed slice takes less than this on the graph is timed by noise (a test's tiny model): it
# keeps `FLOAT_PROMPT_TOKENS` (SmolLM2-135M's 128-token slice takes ~200 ms on 2 cores)
QUICKEST_SECONDS = 0.02
GAIN = 0.95  # float activations pay at a length where their best call takes at most this share of the graph's


def rounds_activations_to_int8(model: Any) -> bool:
    """Whether any MatMulNBits of the graph (a ModelProto) computes with int8 activations (accuracy_level 4)."""
    return any(
        attribute.name == "accuracy_level" and attribute.i == 4
        for node in model.graph.node
        if node.op_type == "MatMulNBits"
        for attribute in node.attribute
    )


def measured_float_from(
    run: Callable[[list[int], bool], object], name: str, vocabulary: Any, longest: int
) -> int | None:
    """The shortest probed length from which `run(tokens, float_activations)` (one prompt slice on an empty cache)
    is faster with float activations at that length and every longer one, or None where it is not even at the
    longest or a call fails (`FLOAT_PROMPT_TOKENS` for a model too quick to time); token ids below `vocabulary`
    (the graph's logits' last dimension: below 100 where it is not a number), no length above `longest` (the
    model's context). The verdict in the log under `name`."""
    try:
        return _probe(run, name, vocabulary if isinstance(vocabulary, int) else 100, longest)
    except Exception as exc:  # noqa: BLE001 (ONNX Runtime's own failures: the graph alone serves, as it can)
        log.warning("%s: float activations not used: %s: %s", name, type(exc).__name__, exc)
        return None


def _probe(run: Callable[[list[int], bool], object], name: str, vocabulary: int, longest: int) -> int | None:
    chosen: int | None = None
    spent = clock()
    for length in [length for length in PROBE_LENGTHS if length <= longest]:
        tokens = [(7 * index) % max(vocabulary - 3, 1) + 3 for index in range(length)]
        took = {False: float("inf"), True: float("inf")}
        for round_ in range(PROBE_ROUNDS):
            for use_float in (False, True) if round_ % 2 == 0 else (True, False):
                started = clock()
                run(tokens, use_float)
                took[use_float] = min(took[use_float], clock() - started)
        if chosen is None and took[False] < QUICKEST_SECONDS:
            log.info(
                "%s: prompts too quick to time here: float activations from %d tokens",
                name,
                FLOAT_PROMPT_TOKENS,
            )
            return FLOAT_PROMPT_TOKENS
        share = took[True] / took[False]
        log.debug("%s: %d-token slice, float activations %.2fx the graph's time", name, length, share)
        if share > GAIN:
            break
        chosen = length
        if clock() - spent > PROBE_SECONDS:
            break
    if chosen is None:
        log.info("%s: float activations do not pay for prompts on this CPU: the graph runs them", name)
    else:
        log.info("%s: prompt slices of %d tokens or more run with float activations", name, chosen)
    return chosen


def return_freed_memory() -> None:
    """Hand the memory freed so far back to the system where the C library can (glibc's `malloc_trim`): a dropped
    session's packed weights otherwise stay in the process's heap (measured: 51 of 143 MB came back without it)."""
    with contextlib.suppress(AttributeError, OSError):  # another C library: its heap keeps them
        ctypes.CDLL(None).malloc_trim(0)

"""From which length a prompt slice of the ONNX engine runs with float activations, measured on this CPU.

The builder's int4/int8 graph for a CPU (MatMulNBits at `accuracy_level: 4`) rounds activations to int8 inside its
matrix products. Whether that pays depends on the CPU's kernels and on how many tokens a call carries: on a Xeon
with AVX-512 VNNI (2 threads, SmolLM2-135M int4) ONNX Runtime's float kernels for the same weights
(`mlas.qnbit.force_fp32`) took 1.3-2.3x as long below 16 tokens, as long at 32, 0.85x at 64 and 0.71x at 256
(docs/results/2026-12-05-serving.md); on an AMD EPYC with AVX2 and no VNNI they took 2.1x as long at one token,
1.07x at 48 and 0.98-1.01x from 96 to 200 (docs/results/2026-12-07-serving-avx2.md): no length where they pay there,
and their session's second packed copy of the weights is memory for nothing. So the server's decoder measures
once, at its first decoder, and keeps the float session only from the shortest length where it is faster at that
length and every longer one probed (`float_from`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
clock = time.perf_counter  # what the probe times both paths with (tests drive their own)

# A decoder made before the decision (or without a runtime to make it) runs slices of this many tokens or more
# with float activations: the Xeon's crossing point above.
FLOAT_PROMPT_TOKENS = 48
# the lengths probed, longest first: the probe stops at the first where float activations do not pay
PROBE_LENGTHS = (128, 96, 64, 48, 32, 24, 16)
PROBE_ROUNDS = 3  # the best of this many calls each, the two paths interleaved (other processes may be busy)
GAIN = 0.95  # float activations pay at a length where their best call takes at most this share of the graph's


def float_from(run: Callable[[list[int], bool], object], name: str) -> int | None:
    """The shortest probed length from which `run(tokens, float_activations)` (one prompt slice on an empty cache)
    is faster with float activations at that length and every longer one, or None where it is not even at the
    longest; the verdict in the log under `name`."""
    chosen: int | None = None
    for length in PROBE_LENGTHS:
        tokens = [(7 * index) % 97 + 3 for index in range(length)]
        took = {False: float("inf"), True: float("inf")}
        for _ in range(PROBE_ROUNDS):
            for use_float in took:
                started = clock()
                run(tokens, use_float)
                took[use_float] = min(took[use_float], clock() - started)
        share = took[True] / took[False]
        log.debug("%s: %d-token slice, float activations %.2fx the graph's time", name, length, share)
        if share > GAIN:
            break
        chosen = length
    if chosen is None:
        log.info("%s: float activations do not pay for prompts on this CPU: the graph runs them", name)
    else:
        log.info("%s: prompt slices of %d tokens or more run with float activations", name, chosen)
    return chosen

"""What speculative decoding buys a variant: the same prompts generated with and without it, interleaved.

Part of a speculative variant's benchmark (tasks/measure/benchmark.py), in the same process and engine. Per
prompt style: generation speed both ways (prefill included, batch 1, greedy, a fixed number of tokens), the paired
speed ratio with its distribution-free interval, how many proposed tokens the variant kept, tokens per verify call,
and how many tokens equal plain decoding's (1.0 where the engine's k-token verify computes what its one-token
decode computes; measured, not assumed).

Prompt styles, both cut from the benchmark's evaluation passage: `continue` (the passage's first
`prompt_tokens` tokens, continued: free text, where proposals are rarely right) and `copy` (a paragraph of it
followed by an instruction to repeat it: editing, quoting and retrieval answers, where the output copies the
input and prompt lookup shines).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tasks.engines.contract import Runtime
from tasks.engines.speculative import Stats
from tasks.measure.sampling import median_interval, repeat_to_length

COPY_INSTRUCTION = "\n\nRepeat the paragraph above word for word:\n\n"


@dataclass(frozen=True)
class StyleSpeed:
    style: str
    prompt_tokens: int
    plain_tok_s: float  # generated tokens per second, prefill included (median of the repeats)
    speculative_tok_s: float
    ratio: float  # median of the per-repeat ratios speculative ÷ plain
    ratio_ci: tuple[float, float]  # distribution-free interval of that median (sampling.median_interval)
    acceptance: float  # proposed tokens kept
    tokens_per_call: float  # tokens per verify call of the variant (1.0: no gain possible)
    agreement: float  # share of positions where the output equals plain decoding's
    proposed: int


def prompt_styles(runtime: Runtime, ids: list[int], prompt_tokens: int) -> dict[str, list[int]]:
    """The prompts of each style from the benchmark passage's ids."""
    paragraph = runtime.decode(ids[: max(16, prompt_tokens // 2)])
    return {
        "continue": repeat_to_length(ids, prompt_tokens),
        "copy": runtime.encode(paragraph + COPY_INSTRUCTION),
    }


def measure_speculation(
    runtime: Runtime, ids: list[int], prompt_tokens: int, new_tokens: int, warmup: int, repeats: int
) -> list[StyleSpeed]:
    """Each style's prompt generated `repeats` times each way (alternating, after `warmup` untimed pairs)."""
    speculation = runtime.speculation
    results = []
    for style, prompt in prompt_styles(runtime, ids, prompt_tokens).items():
        plain_s, speculative_s, outputs = [], [], {}
        for round_ in range(warmup + repeats):
            for enabled in (False, True):
                speculation.enabled = enabled
                if enabled and round_ == warmup:
                    speculation.stats = Stats()  # the timed runs' counts only
                start = time.perf_counter()
                outputs[enabled] = runtime.generate([prompt], new_tokens, stop_at_eos=False)[0]
                elapsed = time.perf_counter() - start
                if round_ >= warmup:
                    (speculative_s if enabled else plain_s).append(elapsed)
        stats = speculation.stats
        ratios = [p / s for p, s in zip(plain_s, speculative_s, strict=True)]
        median, (low, high) = _median(ratios), median_interval(ratios)[:2]
        same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=False))
        results.append(
            StyleSpeed(
                style=style,
                prompt_tokens=len(prompt),
                plain_tok_s=new_tokens / _median(plain_s),
                speculative_tok_s=new_tokens / _median(speculative_s),
                ratio=median,
                ratio_ci=(low, high),
                acceptance=stats.acceptance,
                tokens_per_call=stats.tokens_per_call,
                agreement=same / max(len(outputs[False]), 1),
                proposed=stats.proposed,
            )
        )
    speculation.enabled, speculation.stats = True, Stats()
    return results


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)

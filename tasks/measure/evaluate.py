"""evaluate: perplexity of a runtime on the evaluation split, with per-window losses kept for pairing.

Protocol: the evaluation passages are joined with blank lines and tokenized once by the variant's own tokenizer
without special tokens (no BOS); the first `max_tokens` tokens are cut into consecutive, non-overlapping windows
of `window` tokens (stride = window; a final window shorter than 2 tokens is dropped). Within each window every
token but the first is predicted from the tokens before it in that window. Perplexity = exp(total NLL / total
predicted tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.config import EvaluateConfig, LongContextConfig, TargetConfig
from tasks.engines import Runtime, load_runtime
from tasks.engines.manifest import VariantManifest
from tasks.engines.registry import SERVING_ONLY
from tasks.errors import DataValidationError
from tasks.failpoints import failpoint
from tasks.local_files import code_sha256, staged_file
from tasks.measure.retrieval import RetrievalResult

# What an evaluation's numbers depend on besides the bytes and the text: this module and every engine.
MEASURING_MODULES = (
    "tasks.measure.evaluate",
    "tasks.measure.long_context",
    "tasks.measure.retrieval",
    "tasks.measure.lm_eval_adapter",
    "tasks.engines",
    "tasks.weights",
)


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    predicted_tokens: int
    window_nll: list[float]
    window_tokens: list[int]


def make_windows(ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows over the first `max_tokens` ids; windows too short to predict anything dropped."""
    ids = ids[:max_tokens]
    return [
        ids[start : start + window]
        for start in range(0, len(ids), window)
        if len(ids[start : start + window]) > 1
    ]


def perplexity_from_losses(window_nll: list[float], window_tokens: list[int]) -> float:
    """exp of the token-weighted mean negative log-likelihood."""
    total = sum(window_tokens)
    if total == 0:
        raise ValueError("no predicted tokens: the evaluation text is shorter than two tokens")
    return math.exp(sum(window_nll) / total)


def evaluate_perplexity(
    runtime: Runtime,
    texts: list[str],
    cfg: EvaluateConfig,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Score every window through the runtime (the same object that would serve the variant)."""
    windows = make_windows(runtime.encode("\n\n".join(texts)), cfg.window, cfg.max_tokens)
    nll, counts = [], []
    for index, window in enumerate(windows):
        ((loss, count),) = runtime.score([window])
        nll.append(loss)
        counts.append(count)
        if progress:
            progress(index + 1, len(windows))
    return PerplexityResult(perplexity_from_losses(nll, counts), sum(counts), nll, counts)


@dataclass(frozen=True)
class AgreementResult:
    """How often the variant's greedy continuation equals the baseline's, position by position."""

    token_agreement: float  # matching positions / all generated positions
    exact_match: float  # continuations identical in full / prompts
    prompts: int


@dataclass(frozen=True)
class VariantEvaluation:
    perplexity: PerplexityResult
    agreement: AgreementResult
    continuations: list[list[int]]
    cloze: ClozeResult
    lm_eval: dict[str, float] = field(default_factory=dict)  # '<task>.<metric>' from lm-eval, when configured
    long_context: dict[str, PerplexityResult] = field(
        default_factory=dict
    )  # by window length, when configured
    retrieval: dict[str, RetrievalResult] = field(default_factory=dict)  # the planted facts, by window length


# The long-context settings and the documents they are measured on (`long_context:` set), or None
LongContext = tuple[LongContextConfig, list[tuple[str, str]]] | None


def agreement_prompts(runtime: Runtime, texts: list[str], cfg: EvaluateConfig) -> list[list[int]]:
    """The first `agreement_prompt_tokens` tokens of the first `agreement_prompts` evaluation passages."""
    return [runtime.encode(text)[: cfg.agreement_prompt_tokens] for text in texts[: cfg.agreement_prompts]]


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> AgreementResult:
    """Token-level and exact-match agreement of two sets of greedy continuations of the same prompts.

    Positions after a first mismatch still count: once continuations diverge they rarely re-align, so token-level
    agreement falls with early divergence, which is the behaviour users notice.
    """
    if len(reference) != len(candidate) or not reference:
        raise ValueError("agreement needs the same, non-empty set of prompts for both models")
    matched = total = exact = 0
    for ref, cand in zip(reference, candidate, strict=True):
        length = max(len(ref), len(cand))
        matched += sum(a == b for a, b in zip(ref, cand, strict=False))
        total += length
        exact += ref == cand
    return AgreementResult(matched / total if total else 1.0, exact / len(reference), len(reference))


def evaluate_variant(
    runtime: Runtime,
    texts: list[str],
    cfg: EvaluateConfig,
    reference: list[list[int]] | None,
    progress: Callable[[int, int], None] | None = None,
    long_context: LongContext = None,
) -> VariantEvaluation:
    """Perplexity plus greedy agreement with `reference` (the baseline's continuations; None for the baseline);
    the tail perplexity at each long-context length when `long_context` is given."""
    perplexity = evaluate_perplexity(runtime, texts, cfg, progress)
    prompts = agreement_prompts(runtime, texts, cfg)
    continuations = runtime.generate(prompts, cfg.agreement_new_tokens, stop_at_eos=False)
    agreement = greedy_agreement(reference if reference is not None else continuations, continuations)
    items = cloze_items(texts, cfg.cloze_items, cfg.cloze_context_words)
    if not items:
        raise DataValidationError(
            "evaluation split has no cloze items (sentences ending in a word, at least 8 words into a passage)"
        )
    cloze = cloze_accuracy(runtime, items, cfg.cloze_new_tokens)
    harness = {}
    if cfg.lm_eval_tasks:
        from tasks.measure.lm_eval_adapter import run_lm_eval

        harness = run_lm_eval(runtime, cfg.lm_eval_tasks, cfg.lm_eval_limit)
    at_length, planted = {}, {}
    if long_context:
        at_length = evaluate_long_context(runtime, long_context, progress)
        planted = evaluate_retrieval(runtime, long_context, progress)
    return VariantEvaluation(perplexity, agreement, continuations, cloze, harness, at_length, planted)


def evaluate_long_context(
    runtime: Runtime,
    long_context: tuple[LongContextConfig, list[tuple[str, str]]],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, PerplexityResult]:
    """The tail perplexity at each long-context length (keyed by the length as text, as JSON keeps it), a window
    per document (tasks/measure/long_context.py)."""
    from tasks.measure.long_context import tail_losses

    cfg, documents = long_context
    return {
        str(length): PerplexityResult(perplexity_from_losses(nll, counts), sum(counts), nll, counts)
        for length, (nll, counts) in tail_losses(runtime, documents, cfg, progress).items()
    }


def evaluate_retrieval(
    runtime: Runtime,
    long_context: tuple[LongContextConfig, list[tuple[str, str]]],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, RetrievalResult]:
    """The planted-fact answers at each retrieval length (keyed by the length as text), none without
    `long_context.retrieval` (tasks/measure/retrieval.py)."""
    from tasks.measure.retrieval import retrieval

    cfg, documents = long_context
    if cfg.retrieval is None:
        return {}
    return {str(length): result for length, result in retrieval(runtime, documents, cfg, progress).items()}


@dataclass(frozen=True)
class ClozeItem:
    context: str
    target: str


@dataclass(frozen=True)
class ClozeResult:
    accuracy: float
    correct: list[bool]  # per item, in item order, for paired tests


def cloze_items(texts: list[str], count: int, context_words: int) -> list[ClozeItem]:
    """LAMBADA-style items: the last word of each sentence, predicted from up to `context_words` words before it."""
    items = []
    for text in texts:
        words = text.split()
        for end, word in enumerate(words):
            target = word.rstrip(".!?\"')")
            if word != target and word[-1:] in ".!?" and target.isalpha() and end >= 8:
                items.append(ClozeItem(" ".join(words[max(0, end - context_words) : end]), target))
    return items[:count]


def cloze_accuracy(runtime: Runtime, items: list[ClozeItem], max_new_tokens: int) -> ClozeResult:
    """Correct when the first word of the greedy continuation equals the target word (case-insensitive)."""
    prompts = [runtime.encode(item.context) for item in items]
    continuations = runtime.generate(prompts, max_new_tokens, stop_at_eos=True)
    correct = [
        _first_word(runtime.decode(ids)) == item.target.lower()
        for ids, item in zip(continuations, items, strict=True)
    ]
    return ClozeResult(sum(correct) / len(correct) if correct else 0.0, correct)


def _first_word(text: str) -> str:
    words = text.split()
    return words[0].strip(".,;:!?\"'()").lower() if words else ""


def evaluation_key(
    model_hash: str,
    texts: list[str],
    cfg: EvaluateConfig,
    reference: list[list[int]] | None,
    device: str = "cpu",
    tensor_parallel: int = 1,
    long_context: LongContext = None,
) -> str:
    """Identity of an evaluation: same model (bytes and runtime settings), evaluation text, settings, reference,
    device (a GPU's kernels round differently), ranks (a split model sums in another order) and measuring code."""
    import hashlib
    import json
    from importlib import metadata

    parts = {
        "variant": model_hash,
        "texts": hashlib.sha256("\0".join(texts).encode()).hexdigest(),
        "settings": cfg.model_dump(mode="json"),
        "reference": reference,
        "device": device,
        **({"tensor_parallel": tensor_parallel} if tensor_parallel > 1 else {}),  # unsplit keys as before
        **({"long_context": _long_context_identity(long_context)} if long_context else {}),
        "code": code_sha256(MEASURING_MODULES, skip=SERVING_ONLY),
        "versions": [metadata.version(p) for p in ("torch", "transformers", "onnxruntime-genai")],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _long_context_identity(long_context: tuple[LongContextConfig, list[tuple[str, str]]]) -> dict:
    import hashlib

    settings, documents = long_context
    text = "\0".join(f"{name}\0{body}" for name, body in documents)
    return {
        "settings": settings.model_dump(mode="json"),
        "documents": hashlib.sha256(text.encode()).hexdigest(),
    }


def save_evaluation(path: Path, key: str, evaluation: VariantEvaluation) -> None:
    """Keep an evaluation beside its key so an unchanged variant is not evaluated twice (e.g. by `llmopt bench`)."""
    import json
    from dataclasses import asdict

    with staged_file(path) as staging:
        staging.write_text(json.dumps({"key": key, "evaluation": asdict(evaluation)}))


def load_evaluation(path: Path, key: str) -> VariantEvaluation | None:
    """The saved evaluation if its key matches, else None (missing, stale or unreadable files are recomputed)."""
    import json

    try:
        saved = json.loads(path.read_text())
        if saved["key"] != key:
            return None
        data = saved["evaluation"]
        return VariantEvaluation(
            PerplexityResult(**data["perplexity"]),
            AgreementResult(**data["agreement"]),
            data["continuations"],
            ClozeResult(**data["cloze"]),
            data.get("lm_eval", {}),
            {length: PerplexityResult(**r) for length, r in data.get("long_context", {}).items()},
            {length: RetrievalResult(**r) for length, r in data.get("retrieval", {}).items()},
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def evaluate_or_reuse(
    folder: Path,
    manifest: VariantManifest,
    texts: list[str],
    cfg: EvaluateConfig,
    reference: list[list[int]] | None,
    saved: Path,
    target: TargetConfig,
    progress: Callable[[int, int], None] | None = None,
    long_context: LongContext = None,
) -> tuple[VariantEvaluation, bool]:
    """(evaluation, reused): the evaluation saved in `saved` when its key (bytes, text, settings, reference,
    measuring code) still matches, else a fresh one through the variant's Runtime, saved for next time."""
    key = evaluation_key(
        manifest.model_hash, texts, cfg, reference, target.device, target.tensor_parallel, long_context
    )
    previous = load_evaluation(saved, key)
    if previous is not None:
        return previous, True
    runtime = load_runtime(folder, target)
    evaluation = evaluate_variant(runtime, texts, cfg, reference, progress, long_context)
    failpoint("evaluate")  # tests: SIGKILL with the evaluation measured, not yet saved
    save_evaluation(saved, key, evaluation)
    return evaluation, False

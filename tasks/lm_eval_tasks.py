"""Optional lm-evaluation-harness tasks, run through the variant's own Runtime (so every engine is measured).

For online users: the harness downloads its task datasets from the Hugging Face hub. Install with
`pip install -e '.[lmeval]'` and name tasks in `evaluate.lm_eval_tasks`.
"""

from __future__ import annotations

from typing import Any

from tasks.errors import ConfigError, DataValidationError
from tasks.runtime import Runtime

ROLLING_WINDOW = 1024  # tokens scored per pass for loglikelihood_rolling (perplexity-style tasks)


def require_lm_eval() -> None:
    """Fail before any work when tasks are configured but the harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            "evaluate.lm_eval_tasks needs lm-eval: pip install -e '.[lmeval]' (and network access for the task "
            "datasets), or set evaluate.lm_eval_tasks: []"
        ) from None


def runtime_language_model(runtime: Runtime) -> Any:
    """An lm-eval `LM` answering through `runtime`: loglikelihoods from `score`, generations from `generate`."""
    from lm_eval.api.model import LM

    class RuntimeLM(LM):
        def __init__(self) -> None:
            super().__init__()
            self.runtime = runtime
            self.prefix = [
                runtime.tokenizer.eos_token_id
            ]  # stands in for BOS: the first token gets predicted

        def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
            return [continuation_loglikelihood(self.runtime, *r.args, self.prefix) for r in requests]

        def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
            return [rolling_loglikelihood(self.runtime, r.args[0], self.prefix) for r in requests]

        def generate_until(self, requests: list[Any]) -> list[str]:
            return [
                generate_until(self.runtime, context, options)
                for context, options in (r.args for r in requests)
            ]

    return RuntimeLM()


def continuation_loglikelihood(
    runtime: Runtime, context: str, continuation: str, prefix: list[int]
) -> tuple[float, bool]:
    """log P(continuation | context) and whether greedy decoding would produce exactly the continuation."""
    context_ids = runtime.encode(context) or prefix
    continuation_ids = runtime.encode(continuation)
    (whole, _), (head, _) = runtime.score([context_ids + continuation_ids, context_ids])
    greedy = runtime.generate([context_ids], len(continuation_ids), stop_at_eos=False)[0]
    return -(whole - head), greedy == continuation_ids


def rolling_loglikelihood(runtime: Runtime, text: str, prefix: list[int]) -> float:
    """log P(text) with every token predicted, in windows of ROLLING_WINDOW tokens (each sees only its own)."""
    ids = runtime.encode(text)
    total = 0.0
    for start in range(0, len(ids), ROLLING_WINDOW):
        context = ids[start - 1 : start] if start else prefix
        ((nll, _),) = runtime.score([context + ids[start : start + ROLLING_WINDOW]])
        total -= nll
    return total


def generate_until(runtime: Runtime, context: str, options: dict[str, Any]) -> str:
    """Greedy continuation cut before the first stop string."""
    ids = runtime.generate(
        [runtime.encode(context)], int(options.get("max_gen_toks", 256)), stop_at_eos=True
    )[0]
    text = runtime.decode(ids)
    for stop in options.get("until", []):
        text = text.split(stop)[0]
    return text


def run_lm_eval(runtime: Runtime, tasks: list[str], limit: int | None) -> dict[str, float]:
    """Run the named harness tasks on the variant; numeric results flattened as '<task>.<metric>'."""
    from lm_eval import simple_evaluate

    try:
        results = simple_evaluate(
            model=runtime_language_model(runtime), tasks=tasks, limit=limit, batch_size=1
        )
    except Exception as exc:  # the harness raises many types for unknown tasks and unreachable datasets
        raise DataValidationError(f"lm-eval tasks {tasks}: {str(exc).splitlines()[0]}") from exc
    return {
        f"{task}.{metric.split(',')[0]}": float(value)
        for task, metrics in results["results"].items()
        for metric, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and _is_score(metric)
    }


def _is_score(metric: str) -> bool:
    """Harness result keys that are scores (not their standard errors or the sample count)."""
    return "stderr" not in metric and metric != "sample_len"

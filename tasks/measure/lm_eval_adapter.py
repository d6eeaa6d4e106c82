"""Optional lm-evaluation-harness tasks, run through the variant's own Runtime (so every engine is measured).

The adapter follows the harness's contract for causal models, as its Hugging Face class (`HFLM`) does, so its
scores are comparable with published ones: a (context, continuation) pair is encoded together and split
(`TemplateLM._encode_pair`: trailing context spaces move to the continuation), an empty context is the prefix
token (BOS, or EOS when the tokenizer has none), inputs are left-truncated to the model's context length, and
rolling log-likelihoods use the harness's own windows (`get_rolling_token_windows` + `make_disjoint_window`: the
full context length per window, the last window with as much earlier text as fits). Text is encoded without
special tokens, like `HFLM(add_bos_token=False)`; that is HFLM's default for tokenizers that add no BOS
themselves (SmolLM2's byte-level BPE among them).

For online users: the harness downloads its task datasets from the Hugging Face hub. Install with
`pip install -e '.[lmeval]'` and name tasks in `evaluate.lm_eval_tasks`.
"""

from __future__ import annotations

from typing import Any

from tasks.engines import Runtime
from tasks.errors import ConfigError, DataValidationError

DEFAULT_MAX_GEN_TOKENS = 256  # the harness's default for generate_until


def require_lm_eval() -> None:
    """Fail before any work when tasks are configured but the harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            "evaluate.lm_eval_tasks needs lm-eval: pip install -e '.[lmeval]' (and network access for the task "
            "datasets), or set evaluate.lm_eval_tasks: []"
        ) from None


def continuation_loglikelihood(
    runtime: Runtime, context: list[int], continuation: list[int]
) -> tuple[float, bool]:
    """log P(continuation | context) in nats, and whether greedy decoding from the context gives exactly the
    continuation. `context` must hold at least one token."""
    (whole, _), (head, _) = runtime.score([context + continuation, context])
    greedy = runtime.generate([context], len(continuation), stop_at_eos=False)[0]
    return head - whole, greedy == continuation


def runtime_language_model(runtime: Runtime, max_length: int | None = None) -> Any:
    """An lm-eval `TemplateLM` answering through `runtime`.

    `max_length` is the harness's: the most tokens a window feeds the model besides the one it scores last. It
    defaults to one less than the model's context length, because `Runtime.score` also feeds that last token.
    """
    from lm_eval import utils
    from lm_eval.api.model import TemplateLM

    class RuntimeLM(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.runtime = runtime
            self.max_length = max_length or runtime.context_length - 1

        @property
        def eot_token_id(self) -> int:
            return self.runtime.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.runtime.bos_token_id
            return bos if bos is not None else self.eot_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return self.runtime.encode(string)

        def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
            results = []
            for _, context, continuation in requests:
                ids = (context + continuation)[-(self.max_length + 1) :]
                split = max(1, len(ids) - len(continuation))
                results.append(continuation_loglikelihood(self.runtime, ids[:split], ids[split:]))
            return results

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            totals = []
            for (text,) in (request.args for request in requests):
                windows = utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
                pairs = [((None, None), *utils.make_disjoint_window(window)) for window in windows]
                totals.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(pairs)))
            return totals

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            return [
                generate_until(self.runtime, context, options)
                for context, options in (r.args for r in requests)
            ]

    return RuntimeLM()


def generate_until(runtime: Runtime, context: str, options: dict[str, Any]) -> str:
    """Greedy continuation cut before the first stop string."""
    max_new = int(options.get("max_gen_toks", DEFAULT_MAX_GEN_TOKENS))
    prompt = runtime.encode(context)[-max(1, runtime.context_length - max_new) :]  # left-truncated, like HFLM
    ids = runtime.generate([prompt], max_new, stop_at_eos=True)[0]
    text = runtime.decode(ids)
    until = options.get("until", [])
    for stop in [until] if isinstance(until, str) else until:
        text = text.split(stop)[0]
    return text


def run_lm_eval(runtime: Runtime, tasks: list[str | dict], limit: int | None) -> dict[str, float]:
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

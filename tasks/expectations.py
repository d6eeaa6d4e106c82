"""Great Expectations suites that guard the pipeline's tables (corpus splits now, metric tables later)."""

from __future__ import annotations

import logging
from typing import Any

from tasks.errors import DataValidationError


def run_suite(name: str, frame: Any, expectations: list[Any]) -> list[str]:
    """Validate a pandas frame against `expectations` with an ephemeral GX context; return failure descriptions."""
    import great_expectations as gx

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    batch = (
        context.data_sources.add_pandas(f"{name}-source")
        .add_dataframe_asset(f"{name}-asset")
        .add_batch_definition_whole_dataframe(f"{name}-batch")
    )
    suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name=name, data=batch, suite=suite)
    )
    result = definition.run(batch_parameters={"dataframe": frame})
    return [_describe(name, item) for item in result.results if not item.success]


def _describe(suite: str, item: Any) -> str:
    config = item.expectation_config
    kwargs = {k: v for k, v in config.kwargs.items() if k not in ("batch_id",) and v is not None}
    observed = item.result.get("observed_value", item.result.get("unexpected_count"))
    return f"{suite}: {config.type}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed, observed {observed!r}"


def validate_corpus_splits(splits: dict[str, list[str]], min_words: int) -> None:
    """Both splits non-empty, every passage long enough, no passage duplicated within or across splits."""
    import great_expectations as gx
    import pandas as pd

    rows = [
        {"split": split, "text": text, "words": len(text.split())}
        for split, texts in splits.items()
        for text in texts
    ]
    frame = pd.DataFrame(rows, columns=["split", "text", "words"])
    failures = []
    for split in splits:
        failures += run_suite(
            f"corpus-{split}",
            frame[frame["split"] == split],
            [gx.expectations.ExpectTableRowCountToBeBetween(min_value=1)],
        )
    failures += run_suite(
        "corpus-passages",
        frame,
        [
            gx.expectations.ExpectColumnValuesToNotBeNull(column="text"),
            gx.expectations.ExpectColumnValuesToBeBetween(column="words", min_value=min_words),
            gx.expectations.ExpectColumnValuesToBeUnique(column="text"),
        ],
    )
    if failures:
        raise DataValidationError(f"data validation failed: {failures[0]}" + _more(failures))


def validate_long_documents(documents: list[tuple[str, str]], count: int, min_words: int) -> None:
    """As many documents as configured, each at least `min_words` words, no name or text twice."""
    import great_expectations as gx
    import pandas as pd

    rows = [{"name": name, "text": text, "words": len(text.split())} for name, text in documents]
    frame = pd.DataFrame(rows, columns=["name", "text", "words"])
    failures = run_suite(
        "long-documents",
        frame,
        [
            gx.expectations.ExpectTableRowCountToEqual(value=count),
            gx.expectations.ExpectColumnValuesToBeBetween(column="words", min_value=min_words),
            gx.expectations.ExpectColumnValuesToBeUnique(column="name"),
            gx.expectations.ExpectColumnValuesToBeUnique(column="text"),
        ],
    )
    if failures:
        raise DataValidationError(
            f"long_context: the documents failed validation ({count} of at least {min_words} words wanted, the "
            f"longest window): {failures[0]}" + _more(failures)
        )


def _more(failures: list[str]) -> str:
    return f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""


def validate_metrics_table(rows: list[dict[str, Any]], expected_variants: list[str]) -> None:
    """Every configured variant measured once, every metric finite and physically possible, before selection."""
    import great_expectations as gx
    import pandas as pd

    frame = pd.DataFrame(rows).replace([float("inf"), float("-inf")], float("nan"))
    shares = ["token_agreement", "cloze_accuracy"]
    positive = ["decode_tok_s", "ttft_ms", "size_bytes", "peak_rss_mb", "latency_p95_ms", "roofline_fraction"]
    # served capacity (`served_tok_s_c16`, …): positive where measured (rows without it hold no value)
    served = [c for c in frame.columns if c.startswith(("served_tok_s_", "served_ttft_"))]
    between = gx.expectations.ExpectColumnValuesToBeBetween
    expectations = [
        gx.expectations.ExpectColumnDistinctValuesToEqualSet(column="variant", value_set=expected_variants),
        gx.expectations.ExpectColumnValuesToBeUnique(column="variant"),
        *[
            gx.expectations.ExpectColumnValuesToNotBeNull(column=m)
            for m in ["perplexity", *shares, *positive]
        ],
        between(column="perplexity", min_value=1.0, strict_min=True),
        *[between(column=m, min_value=0.0, max_value=1.0) for m in shares],
        *[between(column=m, min_value=0.0, strict_min=True) for m in positive],
        *[between(column=m, min_value=0.0) for m in served],  # 0 tok/s: every served request failed
    ]
    failures = run_suite("metrics", frame, expectations)
    if failures:
        raise DataValidationError(f"metrics validation failed: {failures[0]}" + _more(failures))

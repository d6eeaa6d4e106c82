"""The Great Expectations suite that guards the metrics table before selection."""

import math

import pytest

from tasks.errors import DataValidationError
from tasks.expectations import validate_metrics_table


def row(variant: str, **overrides) -> dict:
    values = {
        "perplexity": 20.0,
        "token_agreement": 0.0,  # zero agreement is possible, not invalid
        "cloze_accuracy": 0.5,
        "decode_tok_s": 30.0,
        "ttft_ms": 100.0,
        "size_bytes": 1000,
        "peak_rss_mb": 500.0,
        "latency_p95_ms": 900.0,
        "roofline_fraction": 0.3,
    }
    return {"variant": variant, **values, **overrides}


def test_a_complete_finite_table_passes():
    validate_metrics_table([row("baseline"), row("q")], ["baseline", "q"])


@pytest.mark.parametrize(
    ("bad", "expectation"),
    [
        ({"perplexity": math.nan}, "expect_column_values_to_not_be_null(column='perplexity')"),
        ({"decode_tok_s": math.inf}, "expect_column_values_to_not_be_null(column='decode_tok_s')"),
        ({"perplexity": 0.9}, "expect_column_values_to_be_between(column='perplexity'"),
        ({"ttft_ms": 0.0}, "expect_column_values_to_be_between(column='ttft_ms'"),
        ({"token_agreement": 1.5}, "expect_column_values_to_be_between(column='token_agreement'"),
        ({"cloze_accuracy": -0.1}, "expect_column_values_to_be_between(column='cloze_accuracy'"),
        ({"roofline_fraction": math.nan}, "expect_column_values_to_not_be_null(column='roofline_fraction')"),
    ],
)
def test_impossible_metrics_stop_selection_naming_the_expectation(bad, expectation):
    with pytest.raises(DataValidationError, match="metrics validation failed") as error:
        validate_metrics_table([row("baseline"), row("q", **bad)], ["baseline", "q"])
    assert expectation in str(error.value)


def test_a_missing_variant_is_named():
    with pytest.raises(DataValidationError, match="expect_column_distinct_values_to_equal_set"):
        validate_metrics_table([row("baseline")], ["baseline", "q"])

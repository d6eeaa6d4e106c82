"""The order variants are built in: a speculative variant after the variants whose bytes it links (its plain twin
and its draft), and only those; the rest as listed, waiting for nothing."""

from tasks.params import VariantConfig
from tasks.techniques.build import build_order

INT4 = {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32}}]}
Q4 = {"steps": [{"llama_cpp": {"type": "Q4_0"}}]}


def variants() -> dict[str, VariantConfig]:
    return {
        name: VariantConfig.model_validate(recipe)
        for name, recipe in {
            "baseline": {},
            "fp32_draft": {"runtime": {"speculative": {"method": "draft", "draft": "q4", "tokens": 4}}},
            "int4_lookup": {**INT4, "runtime": {"speculative": {"method": "ngram", "tokens": 4}}},
            "int4": INT4,
            "q4": Q4,
        }.items()
    }


def test_speculative_variants_come_after_their_twin_and_draft_and_wait_for_them_only():
    plan = build_order(variants(), ["baseline", "fp32_draft", "int4_lookup", "int4", "q4"])
    assert [name for name, _ in plan] == ["baseline", "int4", "q4", "fp32_draft", "int4_lookup"]
    waits = dict(plan)
    assert waits["fp32_draft"] == ["baseline", "q4"]  # its plain twin (the baseline recipe) and its draft
    assert waits["int4_lookup"] == ["int4"]
    assert waits["baseline"] == waits["int4"] == waits["q4"] == []


def test_a_speculative_variant_whose_twin_is_not_built_waits_for_nothing():
    plan = build_order(variants(), ["int4_lookup", "baseline"])
    assert plan == [("baseline", []), ("int4_lookup", [])]

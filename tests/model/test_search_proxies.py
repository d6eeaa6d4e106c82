"""The recipe search's proxies (tasks/search/proxies.py) on the trained tiny model: KL to the baseline is zero for
the baseline's own bytes and orders 8-bit before 4-bit; the screen drops what is far outside the accuracy budget
and keeps the fastest of the rest."""

from __future__ import annotations

import math

import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.params import VariantConfig
from tasks.search.proxies import Proxy, kl_to_reference, log_probs, proxy, screen, short_decode_tok_s
from tasks.techniques.build import build_variant

TEXT = "the river runs past the old stone bridge and the garden where the music played all winter long"


@pytest.fixture(scope="module")
def runtimes(trained_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("proxies")
    recipes = {
        "baseline": {},
        "int8": {"steps": [{"quantize": {"method": "torchao_int8_weight_only"}}]},
        "int4": {"steps": [{"quantize": {"method": "torchao_int4_weight_only"}}]},
    }
    loaded = {}
    for name, recipe in recipes.items():
        manifest = build_variant(name, VariantConfig.model_validate(recipe), trained_base, "d", root / name)
        loaded[name] = (load_runtime(root / name, TargetConfig(threads=1)), manifest.size_bytes)
    return loaded


def test_kl_is_zero_for_the_baseline_and_orders_eight_bit_before_four_bit(runtimes):
    baseline = runtimes["baseline"][0]
    ids = baseline.encode(TEXT * 3)
    windows = [ids[i : i + 24] for i in (0, 20, 40)]
    reference = log_probs(baseline, windows)
    assert max(kl_to_reference(reference, baseline, windows)) < 1e-6
    found = {
        name: proxy(name, size, runtime, reference, windows, ids[:16])
        for name, (runtime, size) in runtimes.items()
    }
    assert 0 < found["int8"].kl < found["int4"].kl, found
    assert len(found["int4"].kl_windows) == 3 and found["int4"].decode_tok_s > 0
    assert found["int8"].stored_bytes == runtimes["int8"][1]  # as the manifest counts it


def test_kl_refuses_mismatched_windows(runtimes):
    baseline = runtimes["baseline"][0]
    ids = baseline.encode(TEXT)
    reference = log_probs(baseline, [ids[:10]])
    with pytest.raises(ValueError, match="one reference per window"):
        kl_to_reference(reference, baseline, [ids[:10], ids[:10]])
    with pytest.raises(ValueError, match="shape"):
        kl_to_reference(reference, baseline, [ids[:12]])
    with pytest.raises(ValueError):
        short_decode_tok_s(baseline, ids[:8], 0)


def test_screen_drops_far_outside_the_budget_and_keeps_the_fastest_whatever_their_kl_within_it():
    budget = 0.05
    near = math.log1p(budget)
    proxies = [
        Proxy("q4_fast", 100, 0.5 * near, (), 300.0),
        Proxy("q4_slow_bigger", 120, 0.6 * near, (), 260.0),  # further and bigger, but faster than q8: kept
        Proxy("q8", 200, 0.1 * near, (), 250.0),
        Proxy("q3_wild", 80, 20.0 * near, (), 400.0),  # fastest, but far outside the budget
        Proxy("q5", 150, 0.3 * near, (), 220.0),
    ]
    screened = screen(proxies, keep=2, max_ppl_increase=budget)
    assert screened.kept == ["q4_fast", "q4_slow_bigger"]
    assert "KL" in screened.dropped["q3_wild"] and "15 × ln(1 + 0.05)" in screened.dropped["q3_wild"]
    assert "not among the 2 fastest" in screened.dropped["q5"] and "not among" in screened.dropped["q8"]
    assert set(screened.kept) | set(screened.dropped) == {p.candidate for p in proxies}
    wide = screen(proxies, keep=10, max_ppl_increase=budget, kl_margin=30.0)
    assert wide.kept[0] == "q3_wild" and "q3_wild" not in wide.dropped

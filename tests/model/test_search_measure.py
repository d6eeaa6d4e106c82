"""The search's measurements on real engines (tasks/search/measure.py) with the trained tiny model: the course run
over real builds, timings and windows. A candidate with the leader's own bytes (equal cost by construction) is not
promoted on the timing noise of this machine; windows are scored once per variant and split; pairs alternate
which of the two runs first; runtimes are loaded on demand and the least recently used let go."""

from __future__ import annotations

import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.measure.evaluate import make_windows
from tasks.params import VariantConfig
from tasks.search.driver import RacePlan, run_search
from tasks.search.measure import EngineMeasurer
from tasks.techniques.build import build_variant

TEXT = (
    "the river runs past the old stone bridge and the garden where the music played all winter long while the "
    "village market sold letters and bread to every traveller who came down from the forest in the spring "
)


@pytest.fixture(scope="module")
def folders(trained_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    recipes = {"baseline": {}, "int8": {"steps": [{"quantize": {"method": "torchao_int8_weight_only"}}]}}
    built = {}
    for name, recipe in recipes.items():
        manifest = build_variant(name, VariantConfig.model_validate(recipe), trained_base, "d", root / name)
        built[name] = (root / name, manifest.size_bytes)
    built["twin"] = built["baseline"]  # the leader's own bytes under another name: the same cost, planted
    return built


def measurer(
    folders, loads: list[str], keep_loaded: int = 3, journal=None, refuse=False, identities=None
) -> EngineMeasurer:
    def load(name):
        if refuse:
            raise AssertionError(f"{name} loaded again: a kept measurement was measured twice")
        loads.append(name)
        runtime = load_runtime(folders[name][0], TargetConfig(threads=1))
        scored = runtime.score

        def counting(sequences):
            runtime.windows_scored = getattr(runtime, "windows_scored", 0) + len(sequences)
            return scored(sequences)

        runtime.score = counting
        return runtime

    ids = load_runtime(folders["baseline"][0], TargetConfig(threads=1)).encode(TEXT * 12)
    windows = {
        "proxy": make_windows(ids, 24, 24 * 2),
        "search": make_windows(ids[48:], 24, 24 * 16),
        "confirm": make_windows(ids[48 + 24 * 16 :], 24, 24 * 8),
    }
    assert [len(windows[split]) for split in ("proxy", "search", "confirm")] == [2, 16, 8]
    sizes = {name: size for name, (_, size) in folders.items()}
    return EngineMeasurer(
        load, sizes, windows, ids[:12], 8, keep_loaded=keep_loaded, journal=journal, identities=identities
    )


def test_a_candidate_of_the_leaders_own_cost_is_not_promoted_and_windows_are_scored_once(folders):
    loads: list[str] = []
    measured = measurer(folders, loads)
    # alpha 0.002: a false win here is a 0.1 % tail, so this test fails on a broken rule, not on a noisy machine
    plan = RacePlan(
        alpha=0.002, rounds=2, pairs_per_round=3, windows_per_round=8, confirm_pairs=6, confirm_windows=8
    )
    outcome = run_search(["twin", "int8"], "baseline", measured, plan)
    assert outcome.winner != "twin"
    assert outcome.trials["twin"].stage in ("dropped", "measured", "not confirmed", "screened out")
    assert outcome.counts()["proposed"] == 2 and outcome.counts()["proxied"] == 2
    for name in ("baseline", "twin", "int8"):  # each window of each split scored once, whatever the rounds
        runtime = measured.runtime(name)
        assert getattr(runtime, "windows_scored", 0) <= 16 + 8
    assert measured.window_tokens("search", 0, 3) == [23, 23, 23]


def test_pairs_alternate_and_runtimes_load_on_demand(folders):
    loads: list[str] = []
    measured = measurer(folders, loads, keep_loaded=2)
    calls = []
    original = measured._timed_decode
    measured._timed_decode = lambda name: calls.append(name) or original(name)
    first, second = measured.pair("int8", "baseline"), measured.pair("int8", "baseline")
    assert calls == ["int8", "baseline", "baseline", "int8"] and all(speed > 0 for speed in first + second)
    measured.runtime("twin")  # a third: the least recently used (baseline, which ran before int8) goes
    assert "baseline" not in measured._warm  # loaded again, it decodes once untimed again before a timing
    measured.runtime("int8")
    assert loads == ["int8", "baseline", "twin"]
    measured.runtime("baseline")
    assert loads == ["int8", "baseline", "twin", "baseline"]
    with pytest.raises(ValueError, match="16 windows"):
        measured.window_nll("baseline", "search", 0, 17)


def test_a_runtime_in_a_process_of_its_own_answers_as_the_runtime_does(folders):
    """What the search loads (engines apart, tasks/search/isolated.py): the same tokens, scores and logits as the
    runtime in this process, a timed decode from the child, the child's errors as this process's, and the process
    gone once closed."""
    import numpy as np

    from tasks.errors import EngineError
    from tasks.search.isolated import IsolatedRuntime
    from tasks.search.proxies import timed_decode

    local = load_runtime(folders["int8"][0], TargetConfig(threads=1))
    isolated = IsolatedRuntime(folders["int8"][0], TargetConfig(threads=1))
    try:
        ids = isolated.encode(TEXT)
        assert ids == local.encode(TEXT)
        assert isolated.generate([ids[:10]], 6, stop_at_eos=False) == local.generate(
            [ids[:10]], 6, stop_at_eos=False
        )
        ((nll, count),), ((expected, counted),) = isolated.score([ids[:20]]), local.score([ids[:20]])
        assert nll == pytest.approx(expected, rel=1e-5) and count == counted
        assert np.allclose(isolated.position_logits(ids[:12]), local.position_logits(ids[:12]), atol=1e-4)
        assert timed_decode(isolated, ids[:10], 8) > 0
        with pytest.raises(EngineError, match="cannot generate from an empty prompt"):
            isolated.generate([[]], 4)
        assert isolated.encode("still answering") == local.encode("still answering")
    finally:
        isolated.close()
    assert not isolated._process.is_alive()


def test_a_search_resumed_from_its_journal_measures_nothing_it_had_measured(folders, tmp_path):
    """Killed midway and run again, a search is handed back every proxy, window loss and speed pair its journal
    kept, in order, and retraces the same course; another key (other settings, bytes or machine) starts afresh."""
    from tasks.search.journal import Journal

    plan = RacePlan(rounds=2, pairs_per_round=2, windows_per_round=4, confirm_pairs=3, confirm_windows=4)
    first = measurer(folders, [], keep_loaded=4, journal=Journal(tmp_path / "journal.json", "key-1"))
    outcome = run_search(["twin", "int8"], "baseline", first, plan)
    first.close()
    journal = Journal(tmp_path / "journal.json", "key-1")
    assert journal.resumed and "speed pairs" in journal.summary()
    again = measurer(folders, [], keep_loaded=4, journal=journal, refuse=True)  # a load fails the test
    resumed = run_search(["twin", "int8"], "baseline", again, plan)
    assert {n: (t.stage, t.reason) for n, t in resumed.trials.items()} == {
        n: (t.stage, t.reason) for n, t in outcome.trials.items()
    }
    assert not Journal(tmp_path / "journal.json", "key-2").resumed  # other settings: measured afresh
    # kept under the variants' bytes: other bytes under the same names are measured, not handed back
    other = {name: f"other-{name}" for name in folders}
    rebuilt = measurer(folders, [], keep_loaded=4, journal=journal, refuse=True, identities=other)
    with pytest.raises(AssertionError, match="loaded again"):
        run_search(["twin", "int8"], "baseline", rebuilt, plan)

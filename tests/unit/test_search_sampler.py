"""The search's sampler (tasks/search/sampler.py): the grid in the space's order up to the room; Optuna's TPE
proposing each candidate once, deterministic given the proxies it is told (a resumed search retraces it), learning
from them which settings are close and fast, taking every candidate of a small space; the budget stops both."""

from __future__ import annotations

from tasks.search.proxies import Proxy
from tasks.search.sampler import choose_sampler, explore
from tasks.search.space import expand

SPACE = {
    "onnx_genai": {
        "precision": ["int4"],
        "block_size": [16, 32, 64, 128],
        "scales": ["absmax", "weighted"],
        "lm_head": ["int4", "int8"],
        "accuracy_level": [0, 4],
    },
    "llama_cpp": {
        "type": ["Q4_0", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS", "Q5_K_M", "Q8_0"],
        "imatrix": [False, True],
    },
}


def planted(name: str) -> Proxy:
    """Fast and close only for ONNX int4 at block 128 with level 4 (8 of 46 candidates are near it)."""
    fast = ("b128" in name or "block_size128" in name) + ("accuracy_level4" in name) + ("weighted" in name)
    return Proxy(name, 1000, 0.1 / (1 + fast), (), 50.0 + 40.0 * fast)


def run(sampler: str, room: int, fail: set[str] = frozenset(), stop=lambda: False, seed: int = 0):
    candidates = expand(SPACE).candidates
    built, told = [], []

    def build(candidate) -> bool:
        built.append(candidate.name)
        return candidate.name not in fail

    def proxy(name: str) -> Proxy:
        told.append(name)
        return planted(name)

    return explore(candidates, sampler, room, build, proxy, stop, seed=seed), built, told


def test_the_grid_takes_the_space_in_order_up_to_the_room_and_failures_do_not_count():
    names = [c.name for c in expand(SPACE).candidates]
    done, built, told = run("grid", room=5, fail={names[1]})
    assert built == names[:6] and done == names[:1] + names[2:6] and told == done


def test_tpe_proposes_each_candidate_once_and_a_small_space_whole():
    names = {c.name for c in expand(SPACE).candidates}
    done, built, _ = run("tpe", room=100)
    assert sorted(done) == sorted(names) and len(built) == len(set(built))


def test_tpe_is_deterministic_given_what_it_is_told_so_a_resumed_search_retraces_it():
    assert run("tpe", room=20)[0] == run("tpe", room=20)[0]
    assert run("tpe", room=20)[0] != run("tpe", room=20, seed=1)[0]


def test_tpe_learns_from_the_proxies_which_settings_are_close_and_fast():
    grid = [c.name for c in expand(SPACE).candidates]
    chance = sum(planted(name).decode_tok_s for name in grid) / len(grid)
    for seed in range(
        5
    ):  # after its 8 random proposals, faster than the space's mean (seeds 0-4: ×1.12-1.33)
        after_startup = run("tpe", room=24, seed=seed)[0][8:]
        score = sum(planted(name).decode_tok_s for name in after_startup) / len(after_startup)
        assert score > chance * 1.1, (seed, score, chance, after_startup)


def test_the_budget_stops_both_samplers():
    for sampler in ("grid", "tpe"):
        calls = iter(range(100))
        done, _, _ = run(sampler, room=100, stop=lambda calls=calls: next(calls) >= 3)
        assert len(done) == 3


def test_auto_is_the_grid_only_where_it_sees_the_whole_space():
    assert choose_sampler("auto", 46, 60, None) == "grid"
    assert choose_sampler("auto", 46, 40, None) == "tpe"
    assert choose_sampler("auto", 46, 60, 30.0) == "tpe"
    assert choose_sampler("grid", 46, 40, 30.0) == "grid"

"""What a search runs, from params.yaml (tasks/search/course.py, tasks/search/settings.py): the candidates, the
windows, the leader, the record it leaves."""

from __future__ import annotations

import json

import pytest

from tasks.errors import ConfigError
from tasks.params import Config
from tasks.search.course import (
    candidate_room,
    choose_leader,
    proposals,
    split_windows,
    winner_block,
    write_record,
)
from tasks.search.driver import SearchOutcome, Trial
from tasks.search.proxies import Proxy
from tasks.search.space import expand

VARIANTS = {
    "baseline": {},
    "onnx_int8": {"steps": [{"onnx_genai": {"precision": "int8", "block_size": 32}}]},
    "gguf_shipped": {"steps": [{"llama_cpp": {"type": "shipped"}}]},
}
SPACE = {"onnx_genai": {"precision": ["int8"], "block_size": [32, 64, 128]}}


def config(**search) -> Config:
    return Config.model_validate({"variants": VARIANTS, "search": {"space": SPACE, **search}})


def test_proposals_race_the_variants_but_not_the_baseline_or_the_peer_and_each_recipe_once():
    defaults, candidates, notes = proposals(config())
    assert list(defaults) == ["onnx_int8"]  # the peer row is measured beside, never selected: not raced
    assert list(candidates) == ["onnx_genai-int8-block_size64", "onnx_genai-int8-block_size128"]
    assert notes == ["onnx_genai-int8-block_size32: params.yaml's onnx_int8, raced as that"]
    # every candidate is proposed; the sampler builds as many as the room params.yaml's variants leave
    assert candidate_room(config(max_candidates=2), len(defaults)) == 1
    assert candidate_room(config(max_candidates=1), 1) == 0
    with pytest.raises(ConfigError, match="search.space is empty"):
        proposals(Config.model_validate({"variants": VARIANTS}))


def test_the_space_s_peer_rows_the_baseline_and_name_clashes_are_not_raced():
    space = {"llama_cpp": {"type": ["shipped", "Q8_0"]}, "onnx_genai": {"precision": ["fp32"]}}
    variants = {**VARIANTS, "llama_cpp-q8_0": {"steps": [{"llama_cpp": {"type": "Q4_0"}}]}}
    cfg = Config.model_validate({"variants": variants, "search": {"space": space}})
    _, candidates, notes = proposals(cfg)
    assert list(candidates) == ["onnx_genai-fp32"]
    assert notes == [
        "llama_cpp-shipped: params.yaml's gguf_shipped, which is not raced (the baseline or a peer row)",
        "llama_cpp-q8_0: the name of another params.yaml variant; left out (rename that one)",
    ]
    # a peer row the space makes that params.yaml does not have is not raced either
    alone = Config.model_validate(
        {"variants": {"baseline": {}}, "search": {"space": {"llama_cpp": {"type": ["shipped"]}}}}
    )
    assert proposals(alone)[1:] == (
        {},
        ["llama_cpp-shipped: a peer row (the source's own model as shipped), never selected"],
    )
    tp = Config.model_validate(
        {"variants": VARIANTS, "search": {"space": SPACE}, "target": {"device": "cuda", "tensor_parallel": 2}}
    )
    with pytest.raises(ConfigError, match="set target.tensor_parallel: 1"):
        proposals(tp)


def test_settings_name_the_culprit():
    with pytest.raises(ValueError, match="search.leader names 'fastest'"):
        config(leader="fastest")
    with pytest.raises(ValueError, match="'gguf_shipped', a peer row"):
        config(leader="gguf_shipped")
    with pytest.raises(ValueError, match="search.space.onnx_genai.block_size: at least one choice"):
        Config.model_validate({"variants": VARIANTS, "search": {"space": {"onnx_genai": {"block_size": []}}}})


def test_split_windows_are_disjoint_and_too_few_is_an_error_naming_the_settings():
    encode = lambda text: list(range(len(text.split())))  # noqa: E731 — a word per token
    cfg = config(window_tokens=16, rounds=2, windows_per_round=3, confirm_windows=2, proxy_windows=2)
    windows = split_windows(encode, ["w " * 100], ["w " * 200], cfg)
    assert [len(windows[s]) for s in ("proxy", "search", "confirm")] == [2, 6, 2]
    assert windows["search"][-1][-1] < windows["confirm"][0][0]  # held out: later tokens
    with pytest.raises(
        ConfigError, match="gives 6 windows of 16 tokens, the race and its confirmation read 8"
    ):
        split_windows(encode, ["w " * 100], ["w " * 100], cfg)


def test_the_leader_is_the_one_named_or_production_s_or_the_fastest_close_enough():
    proxies = {"a": Proxy("a", 1, 0.01, (), 100.0), "b": Proxy("b", 1, 0.9, (), 300.0)}
    assert choose_leader(config(), proxies, kl_limit=0.5) == "a"  # b is faster but far outside the budget
    assert choose_leader(config(leader="onnx_int8"), proxies, 0.5) == "onnx_int8"
    slower = {
        **proxies,
        "c": Proxy("c", 1, 0.01, (), 90.0),
    }  # production's bytes: the leader, whatever its proxy
    assert choose_leader(config(), slower, 0.5, production="c") == "c"
    assert choose_leader(config(leader="onnx_int8"), slower, 0.5, production="c") == "onnx_int8"
    assert choose_leader(config(), proxies, 0.5, production="elsewhere") == "a"
    assert choose_leader(config(), {"b": proxies["b"]}, 0.5) == "baseline"


def test_the_record_holds_every_trial_and_the_winners_block_only_when_there_is_one(tmp_path):
    candidates = {c.name: c for c in expand(SPACE).candidates}
    trial = Trial("onnx_genai-int8-block_size64", "confirmed", "×1.2", Proxy("x", 1, 0.0, (0.0,), 9.0))
    won = SearchOutcome({trial.name: trial}, trial.name, None)
    files = write_record(tmp_path, won, {trial.name: {"steps": []}}, winner_block(won, candidates))
    assert [f.name for f in files] == ["trials.json", "winner.yaml"]
    assert "onnx_genai-int8-block_size64:" in (tmp_path / "winner.yaml").read_text()
    record = json.loads((tmp_path / "trials.json").read_text())
    assert record["winner"] == trial.name and record["trials"][0]["stage"] == "confirmed"
    lost = SearchOutcome({trial.name: trial}, None, None)
    write_record(tmp_path, lost, {}, winner_block(lost, candidates))
    assert not (tmp_path / "winner.yaml").exists()  # a stale winner is not left behind


def test_the_search_plot_draws_every_proxied_trial(tmp_path):
    from tasks.report.search_plot import search_plot

    records = [
        {"name": "a", "stage": "dropped", "proxy": {"kl": 0.2, "decode_tok_s": 90.0, "stored_bytes": 5}},
        {"name": "b", "stage": "confirmed", "proxy": {"kl": 0.0, "decode_tok_s": 150.0, "stored_bytes": 4}},
        {
            "name": "c",
            "stage": "screened out",
            "proxy": {"kl": 0.9, "decode_tok_s": 160.0, "stored_bytes": 3},
        },
        {"name": "d", "stage": "measured", "proxy": None},
    ]
    path = search_plot(records, ("lead", 0.1, 120.0), 0.73, tmp_path / "search.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000

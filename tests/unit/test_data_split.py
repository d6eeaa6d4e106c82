import json

import pytest

from tasks.config import DataConfig
from tasks.errors import DataValidationError
from tasks.inputs.data import cut_passages, detag_brown, detokenize, read_local, split_passages, write_splits


def test_brown_tags_are_stripped_and_punctuation_reattached():
    raw = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, it/pps did/dod n't/* ./.\n"
    assert detag_brown(raw) == 'The jury said "no evidence", it didn\'t.'


def test_detokenize_handles_brackets_and_contractions():
    assert detokenize("( a ) b 's c ?") == "(a) b's c?"


def test_passages_group_whole_lines_drop_short_tails_and_duplicates():
    line = "one two three four five"
    documents = ["\n".join([line] * 4 + ["tail"]), "\n".join([line] * 4)]
    passages = cut_passages(documents, passage_words=10, min_words=6)
    assert passages == [f"{line} {line}"]  # the second pair and the whole second document duplicate it


def make_passages(count: int) -> list[str]:
    return [f"passage number {i} " + "word " * 20 for i in range(count)]


def test_split_is_deterministic_disjoint_and_sized():
    cfg = DataConfig(evaluation_passages=5, calibration_passages=7)
    passages = make_passages(30)
    first, second = split_passages(passages, cfg), split_passages(list(reversed(passages)), cfg)
    assert first == second
    assert (len(first["evaluation"]), len(first["calibration"])) == (5, 7)
    assert not set(first["evaluation"]) & set(first["calibration"])


def test_split_seed_changes_membership():
    passages = make_passages(40)
    a = split_passages(passages, DataConfig(evaluation_passages=5, seed=0))["evaluation"]
    b = split_passages(passages, DataConfig(evaluation_passages=5, seed=1))["evaluation"]
    assert set(a) != set(b)


def test_written_splits_hash_changes_with_content(tmp_path):
    splits = {"calibration": ["a b c"], "evaluation": ["d e f"]}
    first = write_splits(splits, tmp_path / "one")
    second = write_splits({"calibration": ["a b c"], "evaluation": ["d e g"]}, tmp_path / "two")
    assert first.content_hash != second.content_hash
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["passages"] == {
        "calibration": 1,
        "evaluation": 1,
    }


def test_local_jsonl_needs_the_text_column(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"body": "hello"}\n')
    with pytest.raises(DataValidationError, match="no 'text' field"):
        read_local(path, "text")
    assert read_local(path, "body") == ["hello"]


def test_missing_local_source_is_named(tmp_path):
    with pytest.raises(DataValidationError, match="does not exist"):
        read_local(tmp_path / "nowhere", "text")

"""The Great Expectations suite guarding the corpus splits (real GX, ephemeral context)."""

import pytest

from tasks.config import DataConfig
from tasks.errors import DataValidationError
from tasks.expectations import validate_corpus_splits
from tasks.inputs.data import prepare_data


def small_corpus(source) -> DataConfig:
    """The synthetic corpus cut small: 6 calibration and 4 evaluation passages of about 60 words."""
    return DataConfig(
        source=str(source),
        passage_words=60,
        min_passage_words=20,
        evaluation_passages=4,
        calibration_passages=6,
    )


GOOD = {"calibration": ["alpha beta gamma delta"], "evaluation": ["epsilon zeta eta theta"]}


def test_valid_splits_pass():
    validate_corpus_splits(GOOD, min_words=4)


def test_empty_split_fails_naming_the_expectation():
    with pytest.raises(DataValidationError, match=r"corpus-evaluation: expect_table_row_count_to_be_between"):
        validate_corpus_splits({**GOOD, "evaluation": []}, min_words=4)


def test_passage_shared_by_both_splits_fails_uniqueness():
    with pytest.raises(DataValidationError, match="expect_column_values_to_be_unique"):
        validate_corpus_splits({**GOOD, "evaluation": GOOD["calibration"]}, min_words=4)


def test_short_passage_fails_minimum_word_count():
    with pytest.raises(DataValidationError, match="expect_column_values_to_be_between"):
        validate_corpus_splits({**GOOD, "evaluation": ["too short"]}, min_words=4)


def test_empty_corpus_folder_stops_preparation_and_writes_nothing(tmp_path):
    (tmp_path / "corpus").mkdir()
    out = tmp_path / "data"
    with pytest.raises(DataValidationError, match="row_count"):
        prepare_data(DataConfig(source=str(tmp_path / "corpus")), tmp_path, out)
    assert not out.exists()


def test_synthetic_corpus_prepares_two_disjoint_validated_splits(corpus_dir, tmp_path):
    cfg = small_corpus(corpus_dir)
    prepared = prepare_data(cfg, tmp_path, tmp_path / "data")
    assert prepared.counts == {"calibration": 6, "evaluation": 4}


def test_unchanged_source_settings_and_splits_are_reused_and_any_change_prepares_again(
    corpus_dir, tmp_path, monkeypatch
):
    """A second `prepare` of the same corpus bytes, settings and code reads nothing and validates nothing (the
    splits passed already); a changed source file, setting or split file is prepared and validated again."""
    import shutil

    import tasks.expectations as expectations

    source = tmp_path / "corpus"
    shutil.copytree(corpus_dir, source)
    cfg = small_corpus(source)
    out = tmp_path / "data"
    validations = []
    real = expectations.validate_corpus_splits
    monkeypatch.setattr(expectations, "validate_corpus_splits", lambda *a: validations.append(1) or real(*a))
    first = prepare_data(cfg, tmp_path, out)
    assert prepare_data(cfg, tmp_path, out) == first and len(validations) == 1  # reused
    prepare_data(cfg.model_copy(update={"seed": 1}), tmp_path, out)
    assert len(validations) == 2  # another setting
    prepare_data(cfg, tmp_path, out)
    assert len(validations) == 3  # the folder now holds the seed-1 splits
    (out / "evaluation.jsonl").write_text((out / "evaluation.jsonl").read_text().replace("a", "b", 1))
    assert prepare_data(cfg, tmp_path, out) == first and len(validations) == 4  # a split file changed
    next(source.iterdir()).write_text("Something else entirely, and much shorter.\n")
    assert prepare_data(cfg, tmp_path, out) != first and len(validations) == 5  # the corpus changed

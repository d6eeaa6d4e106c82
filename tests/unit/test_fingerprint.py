import pytest

from tasks.config import TargetConfig
from tasks.errors import ComparisonError
from tasks.measure.fingerprint import ensure_comparable, fingerprint_hash, machine_fingerprint


def test_same_machine_compares_and_a_code_change_does_not_matter():
    here = machine_fingerprint(TargetConfig(threads=2))
    later = {**here, "git_commit": "another"}
    later["hash"] = fingerprint_hash(later)
    ensure_comparable(here, later)


def test_different_threads_or_cpu_are_refused_naming_the_difference():
    here = machine_fingerprint(TargetConfig(threads=2))
    there = {**here, "threads": 8, "cpu_model": "Other CPU"}
    there["hash"] = fingerprint_hash(there)
    with pytest.raises(ComparisonError, match="refusing to compare") as error:
        ensure_comparable(here, there)
    assert "threads: 2 → 8" in str(error.value) and "Other CPU" in str(error.value)

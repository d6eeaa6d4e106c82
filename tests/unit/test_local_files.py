import pytest

from tasks.local_files import code_sha256, file_sha256, folder_sha256, folder_size, staged_file, staged_folder


def test_folder_hash_depends_on_content_and_names_not_creation_order(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, order in ((first, ["x", "y"]), (second, ["y", "x"])):
        (folder / "sub").mkdir(parents=True)
        for name in order:
            (folder / "sub" / name).write_text(f"content {name}")
    assert folder_sha256(first) == folder_sha256(second)
    (second / "sub" / "x").write_text("changed")
    assert folder_sha256(first) != folder_sha256(second)


def test_renaming_a_file_changes_the_folder_hash(tmp_path):
    (tmp_path / "f").write_text("same")
    before = folder_sha256(tmp_path)
    (tmp_path / "f").rename(tmp_path / "g")
    assert folder_sha256(tmp_path) != before


def test_excluded_files_do_not_count(tmp_path):
    (tmp_path / "weights").write_bytes(b"\x00" * 10)
    before = folder_sha256(tmp_path, exclude=("manifest.json",))
    (tmp_path / "manifest.json").write_text("{}")
    assert folder_sha256(tmp_path, exclude=("manifest.json",)) == before
    assert folder_size(tmp_path) == 12


def test_file_hash_matches_known_sha256(tmp_path):
    (tmp_path / "abc").write_bytes(b"abc")
    assert file_sha256(tmp_path / "abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_a_staged_folder_replaces_the_old_one_only_when_the_body_succeeds(tmp_path):
    dest = tmp_path / "variant"
    dest.mkdir()
    (dest / "old").write_text("old")
    with pytest.raises(RuntimeError), staged_folder(dest) as staging:
        (staging / "half").write_text("half-written")
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["variant"] and (dest / "old").is_file()
    with staged_folder(dest) as staging:
        (staging / "new").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["variant"] and [p.name for p in dest.iterdir()] == ["new"]


def test_a_staged_file_leaves_the_previous_version_when_writing_fails(tmp_path):
    dest = tmp_path / "deep" / "evaluation.json"
    with staged_file(dest) as staging:
        staging.write_text("first")
    with pytest.raises(OSError), staged_file(dest) as staging:
        staging.write_text("second, cut short")
        raise OSError("disk full")
    assert dest.read_text() == "first" and [p.name for p in dest.parent.iterdir()] == ["evaluation.json"]


def test_code_keys_follow_modules_by_import_name_wherever_their_files_live():
    from tasks.measure.evaluate import MEASURING_MODULES
    from tasks.techniques.build import BUILDER_MODULES

    package = code_sha256(("tasks.engines",))
    assert package != code_sha256(("tasks.engines.contract",))  # a package counts with all its modules
    assert len({code_sha256(BUILDER_MODULES), code_sha256(MEASURING_MODULES), package}) == 3
    with pytest.raises(ModuleNotFoundError, match="tasks.runtime"):
        code_sha256(("tasks.runtime",))


def test_variants_with_the_same_bytes_but_other_runtime_settings_are_different_models():
    from tasks.engines.manifest import VariantManifest

    def manifest(runtime: dict) -> VariantManifest:
        recipe = {"steps": [], "runtime": {"dtype": "float32", **runtime}}
        return VariantManifest(
            "v", recipe, "r", "b", "base", "data", "hf-safetensors", "float32", "torch", 1, 1, "c"
        )

    plain, eager, explicit = manifest({}), manifest({"attention": "eager"}), manifest({"attention": "sdpa"})
    assert plain.content_hash == eager.content_hash and plain.model_hash != eager.model_hash
    assert plain.model_hash == explicit.model_hash  # a default spelled out is the same model


def test_the_hash_cache_reads_an_unchanged_file_once_and_a_rewritten_one_again(tmp_path, monkeypatch):
    import os
    import time

    from tasks import local_files

    monkeypatch.setenv("LLMOPT_HASH_CACHE", str(tmp_path / "cache.sqlite"))
    weights = tmp_path / "w" / "weights.bin"
    weights.parent.mkdir()
    weights.write_bytes(b"\x01" * 1000)
    old = time.time_ns() - 10**10  # ten seconds ago: past the racy window, so the hash may be remembered
    os.utime(weights, ns=(old, old))
    monkeypatch.setattr(local_files, "_RACY_NS", -(10**12))  # ctime is 'now' here; the guard is tested below
    reads = []
    real = local_files.file_sha256
    monkeypatch.setattr(local_files, "file_sha256", lambda path: reads.append(path) or real(path))
    first = local_files.folder_sha256(weights.parent)
    assert (
        local_files.folder_sha256(weights.parent) == first and len(reads) == 1
    )  # the second look only stats
    moved_folder = weights.parent.rename(tmp_path / "moved")  # a staged folder moved into place: still known
    assert local_files.folder_sha256(moved_folder) == first and len(reads) == 1
    moved = moved_folder / "weights.bin"
    with moved.open("r+b") as handle:  # same size, and mtime set back as `touch -r` would: ctime still moves
        handle.write(b"\x02")
    os.utime(moved, ns=(old, old))
    assert local_files.folder_sha256(moved_folder) != first and len(reads) == 2


def test_a_file_changed_within_the_racy_window_is_not_remembered(tmp_path, monkeypatch):
    from tasks import local_files

    monkeypatch.setenv("LLMOPT_HASH_CACHE", str(tmp_path / "cache.sqlite"))
    (tmp_path / "f").write_bytes(b"fresh")
    reads = []
    real = local_files.file_sha256
    monkeypatch.setattr(local_files, "file_sha256", lambda path: reads.append(path) or real(path))
    local_files.file_hashes(tmp_path, exclude=("cache.sqlite",))
    local_files.file_hashes(tmp_path, exclude=("cache.sqlite",))
    assert len(reads) == 2  # written this second: it could still change within the same timestamp


def test_first_difference_names_the_changed_missing_or_extra_file():
    from tasks.local_files import first_difference

    recorded = {"a": "1", "b": "2"}
    assert first_difference({"a": "1", "b": "2"}, recorded) is None
    assert first_difference({"a": "1", "b": "9"}, recorded) == ("b", "9", "2")
    assert first_difference({"a": "1"}, recorded) == ("b", "(missing)", "2")
    assert first_difference({"a": "1", "b": "2", "c": "3"}, recorded) == ("c", "3", "(not recorded)")


def test_a_package_code_key_follows_its_subpackages(tmp_path, monkeypatch):
    (tmp_path / "toolbox" / "engine").mkdir(parents=True)
    (tmp_path / "toolbox" / "__init__.py").write_text("")
    (tmp_path / "toolbox" / "engine" / "__init__.py").write_text("")
    (tmp_path / "toolbox" / "engine" / "runtime.py").write_text("STEP = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_sha256(("toolbox",))
    (tmp_path / "toolbox" / "engine" / "runtime.py").write_text("STEP = 2\n")
    assert code_sha256(("toolbox",)) != before  # an engine's runtime moved into a subpackage still counts


def test_a_code_key_leaves_out_the_skipped_modules_and_the_serving_only_ones_are_real(tmp_path, monkeypatch):
    """A change to how the server batches (tasks.engines.registry.SERVING_ONLY) rebuilds and re-evaluates nothing;
    a change anywhere else in the package still does."""
    from tasks.engines.registry import SERVING_ONLY

    (tmp_path / "toolbox" / "engine").mkdir(parents=True)
    for path in ("__init__.py", "engine/__init__.py"):
        (tmp_path / "toolbox" / path).write_text("")
    (tmp_path / "toolbox" / "engine" / "runtime.py").write_text("STEP = 1\n")
    (tmp_path / "toolbox" / "engine" / "batch.py").write_text("ROWS = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    skip = ("toolbox.engine.batch",)
    before = code_sha256(("toolbox",), skip=skip)
    (tmp_path / "toolbox" / "engine" / "batch.py").write_text("ROWS = 2\n")
    assert code_sha256(("toolbox",), skip=skip) == before != code_sha256(("toolbox",))
    (tmp_path / "toolbox" / "engine" / "runtime.py").write_text("STEP = 2\n")
    assert code_sha256(("toolbox",), skip=skip) != before
    assert code_sha256(("tasks.engines",), skip=SERVING_ONLY) != code_sha256(("tasks.engines",))
    for (
        name
    ) in SERVING_ONLY:  # each names a module that exists (a rename would otherwise key it again, silently)
        assert code_sha256((name,))

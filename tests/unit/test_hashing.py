from tasks.hashing import file_sha256, folder_sha256, folder_size


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

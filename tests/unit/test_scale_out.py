"""The pieces of scale-out that need no cluster: the content-addressed store (here on a folder; the integration
test runs it on S3), the workspace that routes bytes through it, the timeline's overlap check, the settings."""

from __future__ import annotations

import json

import pytest

from flows.cluster import Stored, Workspace, task_runner, workspace
from tasks.errors import ArtifactError
from tasks.params import Config
from tasks.report.timeline import Span, overlapping, write_timeline
from tasks.shared_store import INDEX, FolderStore, folder_key


def _folder(path, files=None):
    path.mkdir(parents=True)
    for name, text in (files or {"model.safetensors": "weights", "sub/tokenizer.json": "{}"}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_a_folder_goes_through_the_store_under_its_content_key_and_comes_back_identical(tmp_path):
    source = _folder(tmp_path / "built")
    store = FolderStore(str(tmp_path / "store"))
    key = store.put(source)
    assert key == folder_key(source) and store.has(key)
    assert store.put(source) == key  # stored once per content
    copy = store.get(key, tmp_path / "worker" / key)
    assert folder_key(copy) == key
    assert (copy / "sub/tokenizer.json").read_text() == "{}"


def test_a_damaged_object_in_the_store_is_refused_naming_the_file_and_nothing_is_kept(tmp_path):
    store = FolderStore(str(tmp_path / "store"))
    key = store.put(_folder(tmp_path / "built"))
    (tmp_path / "store" / key / "model.safetensors").write_text("weightz")
    with pytest.raises(ArtifactError, match=r"model\.safetensors hashes to .*refusing to use it"):
        store.get(key, tmp_path / "copy")
    assert not (tmp_path / "copy").exists() and not (tmp_path / "copy.partial").exists()


def test_an_upload_interrupted_before_its_index_is_never_read(tmp_path):
    store = FolderStore(str(tmp_path / "store"))
    key = store.put(_folder(tmp_path / "built"))
    (tmp_path / "store" / key / INDEX).unlink()  # as if the uploader died before the last write
    assert not store.has(key)
    with pytest.raises(ArtifactError, match="never uploaded, or its upload was interrupted"):
        store.get(key, tmp_path / "copy")
    assert store.put(tmp_path / "built") == key and store.has(key)  # the next upload completes it


def test_a_copy_that_still_matches_is_not_downloaded_again_and_a_changed_one_is_replaced(tmp_path):
    store = FolderStore(str(tmp_path / "store"))
    key = store.put(_folder(tmp_path / "built"))
    copy = store.get(key, tmp_path / "copy")
    marker = (copy / "model.safetensors").stat().st_ino
    assert (store.get(key, copy) / "model.safetensors").stat().st_ino == marker
    (copy / "model.safetensors").write_text("tampered")
    assert (store.get(key, copy) / "model.safetensors").read_text() == "weights"


def test_the_workspace_uses_the_store_only_on_a_cluster(tmp_path):
    local = Config(variants={"baseline": {}}, cluster={"store": str(tmp_path / "s")})
    assert workspace(local, tmp_path).store is None  # one process: nothing to exchange
    dask = Config(
        variants={"baseline": {}},
        cluster={"runner": "dask", "store": str(tmp_path / "s"), "worker_dir": str(tmp_path / "w")},
    )
    space = workspace(dask, tmp_path)
    assert space.local("variants/x") == tmp_path / "w" / "variants/x"
    stored = space.publish(_folder(tmp_path / ".llmopt" / "variants" / "x"))
    assert stored.key == folder_key(stored.path)
    fetched = space.fetch(stored)
    assert fetched == tmp_path / "w" / "store" / stored.key and folder_key(fetched) == stored.key
    shared = Workspace(tmp_path)
    assert shared.fetch(Stored(tmp_path / "a")) == tmp_path / "a" and shared.publish(tmp_path).key is None


def test_a_benchmark_beside_another_task_on_the_same_machine_is_found():
    build = Span("build", "bf16", "tcp://a:1 on m1", "m1", 0.0, 10.0)
    bench = Span("benchmark", "baseline", "tcp://b:1 on m1", "m1", 9.0, 12.0, "f")
    elsewhere = Span("build", "int8", "tcp://c:1 on m2", "m2", 9.0, 12.0)
    after = Span("evaluate", "bf16", "tcp://a:1 on m1", "m1", 12.0, 13.0)
    assert overlapping([build, bench, elsewhere, after]) == [(bench, build)]
    assert overlapping([bench, elsewhere, after]) == []


def test_the_timeline_is_written_as_data_and_as_a_picture(tmp_path):
    spans = [
        Span("build", "bf16", "w0", "m", 0.0, 2.0),
        Span("benchmark", "bf16", "w1", "m", 2.5, 4.0, "f"),
    ]
    data, picture = write_timeline(spans, tmp_path)
    assert [Span(**s) for s in json.loads(data.read_text())] == spans
    assert picture.read_bytes()[:4] == b"\x89PNG"


def test_cluster_settings_are_checked():
    with pytest.raises(ValueError, match="dask_address is set but runner is local"):
        Config(variants={"baseline": {}}, cluster={"dask_address": "tcp://h:8786"})
    with pytest.raises(ValueError, match="dask_address"):
        Config(variants={"baseline": {}}, cluster={"runner": "dask", "dask_address": "h:8786"})
    with pytest.raises(ValueError, match="services.prefect_worker needs schedule.work_pool"):
        Config(variants={"baseline": {}}, services={"prefect_worker": True})


def test_a_remote_cluster_needs_a_prefect_server_its_workers_can_reach():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.errors import ConfigError
    from tasks.preflight import check_cluster

    config = Config(variants={"baseline": {}}, cluster={"runner": "dask", "dask_address": "tcp://h:8786"})
    with (
        temporary_settings(updates={PREFECT_API_URL: None}),
        pytest.raises(ConfigError, match="PREFECT_API_URL"),
    ):
        check_cluster(config, reach=False)
    with temporary_settings(updates={PREFECT_API_URL: "http://h:4200/api"}):
        check_cluster(config, reach=False)


def test_the_local_runner_runs_one_task_at_a_time():
    runner = task_runner(Config(variants={"baseline": {}}))
    assert type(runner).__name__ == "ThreadPoolTaskRunner" and runner._max_workers == 1


def test_workers_fetching_the_same_folder_at_once_share_one_download(tmp_path):
    import threading

    store = FolderStore(str(tmp_path / "store"))
    key = store.put(_folder(tmp_path / "built", {f"shard{i}.bin": "x" * 100_000 * (i + 1) for i in range(8)}))
    errors, dest = [], tmp_path / "worker" / key

    def fetch() -> None:
        try:
            assert folder_key(store.get(key, dest)) == key
        except Exception as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and folder_key(dest) == key


def test_an_index_that_does_not_match_its_key_or_leaves_its_folder_is_refused(tmp_path):
    store = FolderStore(str(tmp_path / "store"))
    key = store.put(_folder(tmp_path / "built"))
    index = tmp_path / "store" / key / INDEX
    hashes = json.loads(index.read_text())
    index.write_text(json.dumps({"../../outside": next(iter(hashes.values()))}))
    with pytest.raises(ArtifactError, match="its index does not match its key"):
        store.get(key, tmp_path / "copy")
    assert not (tmp_path / "outside").exists()


def test_an_object_missing_from_a_complete_folder_is_one_line_and_leaves_nothing(tmp_path):
    from tasks.errors import StorageError

    store = FolderStore(str(tmp_path / "store"))
    key = store.put(_folder(tmp_path / "built"))
    (tmp_path / "store" / key / "model.safetensors").unlink()
    with pytest.raises(StorageError, match=f"cannot download folder {key[:12]}"):
        store.get(key, tmp_path / "copy")
    assert not (tmp_path / "copy").exists() and not (tmp_path / "copy.partial").exists()


def test_benchmarks_on_another_kind_of_machine_or_beside_other_work_fail_the_run():
    from tasks.errors import ComparisonError
    from tasks.report.timeline import check_benchmarks_clean

    bench = Span("benchmark", "bf16", "w0", "m1", 0.0, 1.0, "aaaa")
    check_benchmarks_clean("aaaa", [bench], "benchmark")
    with pytest.raises(ComparisonError, match="different fingerprints"):
        check_benchmarks_clean(
            "aaaa", [bench, Span("benchmark", "x", "w1", "m2", 2.0, 3.0, "bbbb")], "benchmark"
        )
    with pytest.raises(ComparisonError, match="build int8 ran on m1 during the benchmark of bf16"):
        check_benchmarks_clean("aaaa", [bench, Span("build", "int8", "w1", "m1", 0.5, 2.0)], "benchmark")

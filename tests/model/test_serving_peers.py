"""`llmopt loadtest --peer`: the same requests against llmopt and another OpenAI-compatible server, interleaved,
each repeat and level with requests of its own, and each server's ratio to llmopt (here the peer is a second llmopt
server on the same tiny model, so both do identical work)."""

from __future__ import annotations

import pytest

from serving.loadtest import LoadRequest
from serving.peers import Server, compare, first_model, parse_peer
from tasks.config import ServeConfig, TargetConfig
from tasks.engines import load_runtime
from tests.model.test_serving_app import live_server


@pytest.fixture(scope="module")
def onnx_runtime(tiny_engine_dir):
    return load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1))


def test_peers_get_the_same_requests_each_round_its_own_and_ratios_are_per_repeat(onnx_runtime):
    asked: list[tuple[int, int]] = []
    seen: dict[str, list[int]] = {"llmopt": [], "peer": []}

    def requests_for(repeat: int, level: int) -> list[LoadRequest]:
        asked.append((repeat, level))
        return [LoadRequest(f"The river {repeat} walks {level} the stone {i}", 5) for i in range(4)]

    def progress(repeat, label, result):
        seen[label].append(result.requests)
        assert result.errors == 0 and round(result.tok_s * result.wall_s) == 4 * 5  # ignore_eos: every token

    settings = ServeConfig(max_new_tokens=8)
    with (
        live_server(onnx_runtime, settings) as (ours, _),
        live_server(onnx_runtime, settings, "4") as (theirs, _),
    ):
        assert first_model(theirs) == "tiny/4"
        servers = [Server("llmopt", ours, "tiny/3"), Server("peer", theirs, first_model(theirs))]
        table = compare(servers, requests_for, [1, 2], repeats=2, ignore_eos=True, progress=progress)
    assert asked == [(-1, 1), (0, 1), (0, 2), (1, 1), (1, 2)]  # the warm-up set, then one set per round
    assert seen == {"llmopt": [4, 4, 4, 4], "peer": [4, 4, 4, 4]}
    assert [(row.label, row.concurrency) for row in table] == [
        ("llmopt", 1),
        ("peer", 1),
        ("llmopt", 2),
        ("peer", 2),
    ]
    assert all(row.tok_s_ratio == (1.0, 1.0, 1.0) for row in table if row.label == "llmopt")
    peer = table[1]
    assert peer.tok_s_ratio[1] <= peer.tok_s_ratio[0] <= peer.tok_s_ratio[2] and peer.errors == 0


def test_a_peer_is_url_with_an_optional_label():
    assert parse_peer("http://127.0.0.1:8080=llama-server") == ("http://127.0.0.1:8080", "llama-server")
    assert parse_peer("http://127.0.0.1:8080/") == ("http://127.0.0.1:8080", "127.0.0.1:8080")
    with pytest.raises(ValueError, match="URL\\[=LABEL\\]"):
        parse_peer("localhost:8080")


def test_a_peer_comparison_is_one_mlflow_run_with_each_servers_figures_and_ratios(tmp_path, request):
    import math

    import mlflow
    from mlflow import MlflowClient

    from serving.peers import PeerRow, log_peer_comparison

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    request.addfinalizer(lambda: mlflow.set_tracking_uri(previous))
    nan = float("nan")
    table = [
        PeerRow("llmopt", 16, 200.0, 100.0, 400.0, 0, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
        PeerRow("vllm", 16, 220.0, 90.0, 380.0, 0, (1.1, 1.05, 1.15), (0.95, 0.9, nan)),
    ]
    servers = [Server("llmopt", "http://a", "m/3"), Server("vllm", "http://b", None)]
    entry = {"served_id": "tiny/3", "variant": "onnx_int4"}
    run_id = log_peer_comparison("peers", entry, servers, table, {"repeats": 3})
    run = MlflowClient().get_run(run_id)
    assert (
        run.data.tags["llmopt.kind"] == "loadtest_peers" and run.data.tags["llmopt.peer.vllm"] == "http://b"
    )
    assert run.data.tags["llmopt.model"] == "tiny" and run.data.tags["llmopt.model_version"] == "3"
    assert run.data.params == {"repeats": "3"}
    metrics = run.data.metrics
    assert metrics["vllm.c16.tok_s_ratio"] == 1.1 and metrics["vllm.c16.tok_s_ratio_low"] == 1.05
    assert metrics["llmopt.c16.ttft_p95_ms"] == 400.0
    assert "vllm.c16.ttft_p95_ratio_high" not in metrics  # nan: not measured, not logged
    assert not any(math.isnan(value) for value in metrics.values())

"""The whole pipeline on a tiny model through the real DVC, Prefect and MLflow, then served over HTTP.

One `dvc repro` per module, kept as a copy: each test starts from that state (put back at the same path), sets up
what else it needs itself, and passes alone or in any order."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.integration.project import ProjectStates, make_project, project_env, run, tiny_params

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_prefect")]


@pytest.fixture(scope="module", autouse=True)
def no_pooled_database_connections():
    """MLflow in this process opens an SQLite connection per query: a pooled one would go on reading the database
    file that a restore replaced."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "NullPool")
        yield


@pytest.fixture(scope="module")
def first_repro(
    tmp_path_factory, tiny_model_dir, corpus_dir
) -> tuple[ProjectStates, subprocess.CompletedProcess]:
    """The tiny project after its first `dvc repro` (kept as state "repro") and what that printed."""
    # long context on three corpus files, at windows the tiny model holds (its 512 positions)
    long_context = {
        "source": str(corpus_dir),
        "documents": 3,
        "lengths": [128, 256],
        "tail_tokens": 32,
        "retrieval": {"lengths": [256]},  # 128 cannot hold the tiny tokenizer's question and a 5-digit answer
    }
    # served capacity by length: bursts of 1 and 2 windows of 256 tokens, under an SLO a tiny model always meets
    benchmark = {"long_prompt_tokens": [256], "served_lengths": [256], "served_length_clients": [1, 2]}
    params = tiny_params(
        tiny_model_dir,
        corpus_dir,
        long_context=long_context,
        benchmark=benchmark,
        slo={"ttft_p95_ms": 600_000},
    )
    root = make_project(tmp_path_factory.mktemp("e2e") / "project", params)
    # the default path, Prefect's own ephemeral server included
    result = run(root, "dvc", "repro", ephemeral_prefect=True)
    states = ProjectStates(root)
    states.save("repro")
    return states, result


@pytest.fixture
def repro_state(first_repro) -> Path:
    """The project just after its first `dvc repro`, for a test that only reads it."""
    return first_repro[0].restore("repro", read_only=True)


@pytest.fixture
def project(first_repro) -> Path:
    """The project just after its first `dvc repro`, for a test that changes it."""
    return first_repro[0].restore("repro")


@pytest.fixture(scope="module")
def challenger_won(first_repro) -> tuple[ProjectStates, str, subprocess.CompletedProcess]:
    """Production forced to a registered fp32 baseline, then a run offering the same model in ONNX Runtime GenAI
    fp32: kept as state "challenger won", with the baseline's version and what the run printed."""
    states = first_repro[0]
    root = states.restore("repro")
    baseline_version = register_folder(root, "baseline")
    run(root, "llmopt", "promote", baseline_version, "--force", "--reason", "start from the slow model")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["variants"] = {"baseline": {}, "onnx_fp32": {"steps": [{"onnx_genai": {"precision": "fp32"}}]}}
    (root / "faster.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = run(root, "llmopt", "run", "-p", "faster.yaml")
    states.save("challenger won")
    return states, baseline_version, result


@pytest.fixture
def after_challenger(challenger_won) -> tuple[Path, str, subprocess.CompletedProcess]:
    """The project just after the run whose fp32 ONNX challenger beat the slow production."""
    states, baseline_version, result = challenger_won
    return states.restore("challenger won"), baseline_version, result


def mlflow_client(root: Path):
    from mlflow import MlflowClient

    return MlflowClient(
        tracking_uri=f"sqlite:///{root / 'mlflow.db'}", registry_uri=f"sqlite:///{root / 'mlflow.db'}"
    )


def test_repro_prints_leaderboard_and_registration(first_repro):
    _, result = first_repro
    assert "Leaderboard" in result.stdout
    for variant in ("baseline", "bf16", "int8_dynamic", "onnx_int8"):
        assert variant in result.stdout
    root = first_repro[0].restore("repro", read_only=True)
    assert (
        "ppl@256 × (CI)" in (root / ".llmopt/reports/leaderboard.md").read_text()
    )  # long context: its column
    documents = (root / ".llmopt/data/long_documents.jsonl").read_text().splitlines()
    assert len(documents) == 3  # chosen, validated and versioned with the corpus splits
    assert "Registered tiny-test version 1" in result.stderr
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("Report: ") and "report.html" in line for line in lines[-6:])
    assert any(line.startswith("Time: prepare ") for line in lines[-6:])
    assert "workflowType=machine_learning" in result.stderr  # the MLflow link opens the runs table


def test_the_run_report_compares_baseline_and_challenger_and_says_what_was_decided(repro_state):
    root = repro_state
    page = (root / ".llmopt/reports/report.html").read_text()
    assert "Production moved to v1: no production version yet" in page
    assert "baseline (baseline)" in page and "data:image/png;base64," in page  # plots inlined: one file
    for measure in (
        "time to first token, ms",
        "per-token latency, ms",
        "request latency p95, ms",
        "peak RSS, MB",
    ):
        assert measure in page
    markdown = (root / ".llmopt/reports/report.md").read_text()
    assert "| throughput tok/s, batch 2 |" in markdown and "## Machine and time" in markdown


def test_mlflow_has_one_parent_with_a_nested_run_per_variant(repro_state):
    root = repro_state
    client = mlflow_client(root)
    experiment = client.get_experiment_by_name("llmopt")
    assert experiment.artifact_location == (root / "mlruns").as_uri()
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("llmopt.kind") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.params["select.max_ppl_increase"] == "0.5"
    assert len(parents[0].data.params["data_hash"]) == 64
    assert parents[0].data.metrics["winner_decode_tok_s"] > 0
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == ["baseline", "bf16", "int8_dynamic", "onnx_int8"]
    for child in children:
        assert child.data.metrics["perplexity"] > 1
        assert child.data.metrics["decode_tok_s"] > 0
        assert child.data.metrics["size_mb"] > 0
        assert {
            "ppl_ratio_ci_high",
            "token_agreement",
            "cloze_accuracy",
            "cloze_p_value",
        } <= child.data.metrics.keys()
        assert child.data.metrics["ppl_ctx256"] > 1 and child.data.metrics["ppl_ratio_ctx256_ci_high"] > 0
        assert 0 <= child.data.metrics["retrieval_ctx256_depth0.5"] <= 1  # the planted facts, by depth
        assert child.data.metrics["ttft_ms_ctx256"] > 0 and child.data.metrics["kv_mb_ctx256"] > 0
        assert child.data.metrics["roofline_fraction_ctx256"] > 0  # weights and the cache read per token
    baseline = next(c for c in children if c.info.run_name == "baseline").data.metrics
    # compared with itself: every statistic must be exactly neutral
    assert baseline["ppl_ratio_ci_low"] == baseline["ppl_ratio_ci_high"] == baseline["token_agreement"] == 1.0
    assert baseline["ppl_ratio_ctx128_ci_low"] == baseline["ppl_ratio_ctx256_ci_high"] == 1.0
    assert baseline["cloze_p_value"] == 1.0 and baseline["cloze_delta"] == 0.0
    artifacts = {a.path for a in client.list_artifacts(parents[0].info.run_id, "reports")}
    assert {"reports/leaderboard.md", "reports/tradeoff.png", "reports/report.html"} <= artifacts
    timings = parents[0].data.metrics
    assert timings["wall_s"] >= timings["stage_s.build"] + timings["stage_s.benchmark"] > 0
    onnx = next(c for c in children if c.info.run_name == "onnx_int8").data
    # served capacity through the real scheduler, at each of benchmark.served_clients, for every candidate (the
    # baseline only under objective: serving)
    for child in children:
        metrics = child.data.metrics
        if child.info.run_name == "baseline":
            assert "served_tok_s_c3" not in metrics
            continue
        assert metrics["served_tok_s_c3"] > 0 and metrics["served_ttft_p95_ms_c1"] > 0, child.info.run_name
        # ... and by window length: both bursts of 256-token windows within the SLO, the server's memory with them
        assert metrics["served_clients_ctx256"] == 2 and metrics["served_peak_rss_mb_ctx256_c2"] > 0
        assert metrics["served_peak_rss_mb"] >= metrics["peak_rss_mb"]
    assert onnx.params["technique"] == "onnx_genai" and onnx.params["weight_bits"] == "8"
    assert onnx.params["onnx_genai.block_size"] == "32" and onnx.params["runtime.dtype"] == "float32"
    assert onnx.tags["llmopt.fingerprint"] == parents[0].data.tags["llmopt.fingerprint"]
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_variant_whose_file_parses_wrong_though_its_hash_matches_fails_alone_and_the_run_goes_on(project):
    """An export cut short and hashed as written (the folder passes its integrity check and is reused): its first
    load names the file in ONNX Runtime's words, the run marks it failed (leaderboard, report, a FAILED nested
    run) and ranks the others."""
    from tests.factories import damage_as_hashed

    root = project
    folder = root / ".llmopt" / "variants" / "onnx_int8"
    damage_as_hashed(folder, "model.onnx")
    result = run(root, "llmopt", "run")
    said = f"{folder}: ONNX Runtime cannot load this model: Load model from {folder}/model.onnx failed:"
    output = result.stdout + result.stderr
    assert f"Failed, left out of this run: onnx_int8: {said}" in output and "Traceback" not in output, output[
        -3000:
    ]
    board = json.loads((root / ".llmopt" / "reports" / "leaderboard.json").read_text())
    assert "Protobuf parsing failed" in board["failed"]["onnx_int8"] and board["winner"] != "onnx_int8"
    assert {row["score"]["variant"] for row in board["rows"]} >= {"baseline", "bf16", "int8_dynamic"}
    assert "onnx_int8" not in {row["score"]["variant"] for row in board["rows"]}
    assert "Failed, left out of the ranking" in (root / ".llmopt" / "reports" / "report.html").read_text()
    client = mlflow_client(root)
    experiment = client.get_experiment_by_name("llmopt").experiment_id
    (latest, *_) = client.search_runs(
        [experiment], "tags.`llmopt.kind` = 'pipeline'", order_by=["start_time DESC"]
    )
    assert latest.info.status == "FINISHED"
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{latest.info.run_id}'")
    failed = [c for c in children if c.info.status == "FAILED"]
    assert [c.info.run_name for c in failed] == ["onnx_int8"] and not failed[0].data.metrics
    assert failed[0].data.tags["llmopt.failed_stage"] == "evaluate"
    assert "Protobuf parsing failed" in failed[0].data.tags["llmopt.failure"]


def test_winner_is_registered_with_lineage_and_both_aliases(repro_state):
    root = repro_state
    client = mlflow_client(root)
    board = json.loads((root / ".llmopt/reports/leaderboard.json").read_text())
    production = client.get_model_version_by_alias("tiny-test", "production")
    candidate = client.get_model_version_by_alias("tiny-test", "candidate")
    assert str(production.version) == str(candidate.version) == "1"
    assert production.tags["llmopt.variant"] == board["winner"]
    manifest = json.loads((root / ".llmopt/variants" / board["winner"] / "manifest.json").read_text())
    assert production.tags["llmopt.content_hash"] == manifest["content_hash"]
    assert production.tags["llmopt.gate"].startswith("passed")
    assert production.description.startswith(f"{board['winner']}: ")


def test_dvc_is_clean_up_to_date_and_pushes_weights(project):
    root = project
    status = run(root, "dvc", "status").stdout
    assert status.split() == ["prepare:", "always", "changed"], (
        status
    )  # the model source lies outside DVC's view
    again = run(root, "dvc", "repro")
    assert "Stage 'optimize' didn't change" in again.stdout and "Registered" not in again.stderr
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    outs = {out["path"]: out for out in lock["stages"]["optimize"]["outs"]}
    assert (
        outs[".llmopt/variants"]["nfiles"] >= 3 * 3
    )  # three variants: weights, config, tokenizer, manifest …
    run(root, "dvc", "push")
    assert "in sync" in run(root, "dvc", "status", "--cloud").stdout
    assert any((root.parent / "dvc-remote").rglob("*"))


def test_a_slower_second_run_leaves_production_then_forced_promotion_and_rollback_are_recorded(project):
    """Run 2 against the same store offers only slower variants: production must not move. Then a forced
    promotion and a rollback; `llmopt history` lists the four decisions with their reasons."""
    root = project
    client = mlflow_client(root)
    first = client.get_model_version_by_alias("tiny-test", "production")
    assert (
        first.tags["llmopt.variant"] == "onnx_int8"
    )  # ORT int8 decodes the tiny model far faster than torch
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["variants"] = {"baseline": {}, "bf16": {"runtime": {"dtype": "bfloat16"}}}
    (root / "slower.yaml").write_text(yaml.safe_dump(params, sort_keys=False))  # same store, same model
    second = run(root, "llmopt", "run", "-p", "slower.yaml")
    last_line = second.stderr.strip().splitlines()[-1]
    assert last_line.startswith("production unchanged: ") and "production v1" in last_line, second.stderr[
        -3000:
    ]
    assert client.get_model_version_by_alias("tiny-test", "production").version == first.version
    runs = client.search_runs(
        [client.get_experiment_by_name("llmopt").experiment_id], "tags.`llmopt.kind` = 'pipeline'"
    )
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}

    baseline_version = register_baseline(root)
    forced = run(root, "llmopt", "promote", baseline_version, "--force", "--reason", "fp32 for an audit")
    assert f"production → v{baseline_version} (forced: fp32 for an audit)" in forced.stderr
    refused = run(root, "llmopt", "promote", "1", "--force", check=False)
    assert (
        refused.returncode == 2
        and "--force needs --reason" in refused.stderr
        and "Traceback" not in refused.stderr
    )
    back = run(root, "llmopt", "rollback", "--reason", "audit done")
    assert f"production → v{first.version} (rollback: audit done)" in back.stderr
    shown = " ".join(run(root, "llmopt", "history").stdout.split())
    for reason in ("no production version yet", "nothing to move", "fp32 for an audit", "audit done"):
        assert reason in shown, shown
    moves = production_history(root)
    assert [(m.kind, m.moved) for m in moves] == [
        ("gate", True),
        ("gate", False),
        ("forced", True),
        ("rollback", True),
    ]
    assert moves[3].from_version == baseline_version and moves[3].to_version == str(first.version)


def production_history(root: Path) -> list:
    import mlflow

    from tasks.decide.history import history

    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_registry_uri(uri)
    mlflow.set_tracking_uri(uri)
    return history("tiny-test")


def test_a_faster_equally_accurate_challenger_beats_a_slow_production_and_is_promoted(after_challenger):
    """Production forced to the slow fp32 baseline; a run offering the same model in ONNX Runtime GenAI fp32 wins
    the duel (interleaved trials, speed-ratio interval) and passes the accuracy checks against production."""
    root, baseline_version, result = after_challenger
    client = mlflow_client(root)
    production = client.get_model_version_by_alias("tiny-test", "production")
    assert production.tags["llmopt.variant"] == "onnx_fp32", result.stderr[-3000:]
    verdict = json.loads(production.tags["llmopt.verdict"])
    assert verdict["champion_version"] == baseline_version and verdict["speed_ratio_ci"][0] > 1.05
    # the same float32 weights in two float32 engines: their perplexities differ in rounding only (~1e-6)
    assert verdict["fingerprint"] and abs(verdict["ppl_ratio_vs_champion"] - 1) < 1e-3
    assert f"beats production v{baseline_version}" in result.stderr.strip().splitlines()[-1]
    # the gate alone: the slow baseline must not pass, and a refusal exits 1
    gated = run(root, "llmopt", "promote", baseline_version, check=False)
    assert (
        gated.returncode == 1 and "error: production unchanged: baseline refused: latency ×" in gated.stderr
    )
    assert client.get_model_version_by_alias("tiny-test", "production").version == production.version


def test_the_serving_objective_duels_on_served_capacity_and_shows_it_on_the_leaderboard(after_challenger):
    """`select.objective: serving` end to end: the leaderboard carries every model's served tok/s and TTFT p95 at
    the most clients, and the gate duels on served capacity (measured again in each duel trial). On the CPU the
    torch engine steps each served request in its own forward call while ONNX Runtime batches them, so the fp32
    baseline cannot beat the ONNX fp32 production on serving any more than on latency."""
    root, baseline_version, _ = after_challenger
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["select"] = {**params["select"], "objective": "serving", "duel_trials": 2}
    (root / "serving.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    gated = run(root, "llmopt", "promote", baseline_version, "-p", "serving.yaml", check=False)
    assert gated.returncode == 1 and "baseline refused: serving ×" in gated.stderr, gated.stderr[-3000:]
    board = (root / ".llmopt/promote/leaderboard.md").read_text()  # `llmopt promote` reports there
    header = board.splitlines()[0]
    assert "c3 tok/s" in header and "c3 TTFT p95" in header
    rows = [line for line in board.splitlines()[2:] if line.startswith("| ")]
    assert rows and all(line.count(" – ") == 0 for line in rows)  # every model served and measured


def register_baseline(root: Path) -> str:
    return register_folder(root, "baseline")


def register_folder(root: Path, variant: str) -> str:
    """Register a variant folder of the project as a new version (what `llmopt run` does for a winner)."""
    script = (
        "import sys; from pathlib import Path; import mlflow; "
        "from tasks.decide.model_registry import register_variant; from tasks.engines.manifest import read_manifest; "
        "uri = 'sqlite:///' + str(Path('mlflow.db').resolve()); mlflow.set_tracking_uri(uri); mlflow.set_registry_uri(uri); "
        f"folder = Path('.llmopt/variants/{variant}'); "
        "run = mlflow.MlflowClient().create_run(mlflow.get_experiment_by_name('llmopt').experiment_id).info.run_id; "
        f"print(register_variant('tiny-test', folder, read_manifest(folder), run, {{}}, '{variant}').version); "
        "mlflow.MlflowClient().set_terminated(run)"
    )
    return run(root, sys.executable, "-c", script).stdout.strip().splitlines()[-1]


def test_a_planted_regression_within_budget_but_worse_than_production_is_never_promoted_though_fastest(
    after_challenger,
):
    """Production forced to the slow fp32 baseline; the challenger is the ONNX fp32 variant (far faster) with a
    bias planted on one logit: every window's loss rises a little (within the +50% baseline budget, so it
    qualifies), which the paired bootstrap against production must catch although the challenger wins on speed."""
    root, baseline_version, _ = after_challenger
    client = mlflow_client(root)
    before = client.get_model_version_by_alias("tiny-test", "production").version
    run(root, "llmopt", "promote", baseline_version, "--force", "--reason", "a slow champion")
    plant_logit_bias(root / ".llmopt/variants/onnx_fp32", root / ".llmopt/variants/planted", bias=2.4)
    planted = register_folder(root, "planted")

    refused = run(root, "llmopt", "promote", planted, check=False)
    last_line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert last_line.startswith(f"error: production unchanged: candidate-v{planted} refused: perplexity ×")
    assert "latency" not in last_line  # the speed side passed: accuracy alone refused it
    assert not any(
        line.startswith("production unchanged") for line in refused.stderr.splitlines()
    )  # said once
    verdict = json.loads(client.get_model_version("tiny-test", planted).tags["llmopt.verdict"])
    assert verdict["speed_ratio_ci"][0] > verdict["speed_threshold"]  # it is the fastest by a wide margin
    assert 1.005 < verdict["ppl_ratio_vs_champion_ci"][0] < verdict["ppl_ratio_vs_champion"] < 1.5
    assert str(client.get_model_version_by_alias("tiny-test", "production").version) == baseline_version
    assert production_history(root)[-1].moved is False
    run(root, "llmopt", "rollback", "--reason", "back to the fast production")
    assert client.get_model_version_by_alias("tiny-test", "production").version == before


def plant_logit_bias(source: Path, target: Path, bias: float) -> None:
    """Copy an ONNX Runtime GenAI variant and add `bias` to the logit of one token the text never uses: every
    position loses a little probability mass to it, so every evaluation window gets slightly worse."""
    import shutil

    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from tasks.local_files import folder_sha256

    shutil.copytree(source, target)
    model = onnx.load(target / "model.onnx")
    graph = model.graph
    producer = next(node for node in graph.node if "logits" in node.output)
    producer.output[list(producer.output).index("logits")] = "logits_unbiased"
    vocab = graph.output[0].type.tensor_type.shape.dim[2].dim_value
    boost = np.zeros(vocab, dtype=np.float32)
    boost[0] = bias  # <unk>: byte-level BPE never encodes text to it, so no position gains
    graph.initializer.append(numpy_helper.from_array(boost, "planted_logit_bias"))
    graph.node.append(helper.make_node("Add", ["logits_unbiased", "planted_logit_bias"], ["logits"]))
    (target / "model.onnx.data").unlink()
    onnx.save(model, target / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    manifest = json.loads((target / "manifest.json").read_text())
    manifest.update(name=target.name, content_hash=folder_sha256(target, exclude=("manifest.json",)))
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_bench_reuses_evaluations_reports_spread_and_refuses_another_machine(project):
    root = project
    result = run(root, "llmopt", "bench", "--trials", "2")
    assert "Repeatability" in result.stdout and "evaluation unchanged" in result.stderr
    bench = json.loads((root / ".llmopt/bench/bench.json").read_text())
    assert {name: len(trials) for name, trials in bench["trials"].items()} == dict.fromkeys(
        ["baseline", "bf16", "int8_dynamic", "onnx_int8"], 2
    )
    assert [b["batch_size"] for b in bench["trials"]["baseline"][0]["batches"]] == [1, 2]
    assert (root / ".llmopt/bench/speed.png").stat().st_size > 10_000
    client = mlflow_client(root)
    runs = client.search_runs(
        [client.get_experiment_by_name("llmopt").experiment_id], "tags.`llmopt.kind` = 'bench'"
    )
    assert len(runs) == 1 and runs[0].data.metrics["memory_read_bandwidth_gbs"] > 0
    assert "spread_baseline_decode_tok_per_s_bs1" in runs[0].data.metrics

    previous = root / "previous-bench.json"
    previous.write_bytes((root / ".llmopt/bench/bench.json").read_bytes())
    again = run(root, "llmopt", "bench", "--trials", "1", "--compare", str(previous))
    assert "Against the compared run" in again.stdout and "onnx_int8" in again.stdout

    bench["fingerprint"].update(cpu_model="Another CPU", hash="0" * 16)
    foreign = root / "foreign-bench.json"
    foreign.write_text(json.dumps(bench))
    refused = run(root, "llmopt", "bench", "--compare", str(foreign), check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "refusing to compare" in refused.stderr and "cpu_model: " in refused.stderr
    assert "Another CPU" in refused.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_answers_completions_from_the_production_alias(project):
    root = project
    served = f"tiny-test/{mlflow_client(root).get_model_version_by_alias('tiny-test', 'production').version}"
    port = free_port()
    server = subprocess.Popen(
        ["llmopt", "serve", "--port", str(port)],
        cwd=root,
        env=project_env(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline, health = time.monotonic() + 120, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.TransportError:
                time.sleep(0.2)  # polling for readiness, bounded by the deadline
        assert health is not None, server.stdout.read().decode() if server.poll() is not None else "no answer"
        assert health["model"] == served
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["tiny-test@production"]
        reply = client.completions.create(model="tiny-test@production", prompt="The river", max_tokens=4)
        assert (
            reply.model == served and reply.usage.completion_tokens <= 4
        )  # the answer names the exact version
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 422
        url = f"http://127.0.0.1:{port}"
        load = run(root, "llmopt", "loadtest", "--url", url, "--concurrency", "1,3", "--requests", "6")
        assert "Load test" in load.stdout + load.stderr
        version = served.rpartition("/")[2]
        tag = mlflow_client(root).get_model_version("tiny-test", version).tags["llmopt.loadtest_run"]
        metrics = mlflow_client(root).get_run(tag).data.metrics
        assert metrics["c3.errors"] == 0 and metrics["c3.tok_s"] > 0 and metrics["c1.requests"] == 6
        assert "offline_decode_tok_s_bs2" in metrics  # the pipeline benchmark's largest batch, as the ceiling
        # the same requests offline through the same engine, with one client and with the most
        assert metrics["offline_same_mix.c1.tok_s"] > 0 and metrics["offline_same_mix.c3.tok_s"] > 0
        assert "offline, same requests, same engine, 3 clients" in load.stdout + load.stderr
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_registered_versions_serve_from_an_environment_mlflow_builds_outside_the_checkout(project, tmp_path):
    """`mlflow models serve --env-manager virtualenv` from a folder where `import tasks` fails: the model carries
    its engine code and pinned requirements. Production (ONNX Runtime GenAI) and the baseline version (PyTorch)
    share one environment, built once."""
    root = project
    baseline_version = register_baseline(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    env = {k: v for k, v in project_env(root).items() if k != "PYTHONPATH"}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}", MLFLOW_ENV_ROOT=str(tmp_path / "envs"))
    for uri in ("models:/tiny-test@production", f"models:/tiny-test/{baseline_version}"):
        port = free_port()
        command = ["mlflow", "models", "serve", "-m", uri, "--env-manager", "virtualenv", "-p", str(port)]
        server = subprocess.Popen(
            command,
            cwd=outside,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until_serving(server, timeout_s=600)
            body = {"inputs": ["The river walks the"], "params": {"max_new_tokens": 3}}
            reply = httpx.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=60)
            (text,) = reply.raise_for_status().json()["predictions"]
            assert isinstance(text, str) and len(text.split()) <= 3, (uri, text)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    (built,) = (tmp_path / "envs").glob("mlflow-*/bin/python")  # one environment served both versions
    probe = "import mlflow, onnxruntime_genai, torch; import tasks"
    result = subprocess.run([str(built), "-c", probe], cwd=outside, env=env, capture_output=True, text=True)
    assert "No module named 'tasks'" in result.stderr  # llmopt is not installed there: the model brought it


def wait_until_serving(server: subprocess.Popen, timeout_s: float) -> None:
    """Block until the server logs that uvicorn listens (it first builds its environment); a reader thread keeps
    draining its output so the pipe never fills, and keeps what it read for the failure message."""
    ready, lines = threading.Event(), []

    def read() -> None:
        for line in server.stdout:
            lines.append(line.decode(errors="replace"))
            if "Uvicorn running on" in lines[-1]:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(timeout_s), "".join(lines)[-4000:] or "no output"


def test_dvc_experiment_runs_with_a_changed_param_and_every_imported_module_is_a_stage_dependency(project):
    """`dvc exp run -S` reruns `optimize` with another budget; Python's import-time report of that very run lists
    every llmopt module the stage loaded, and each must lie inside a dependency of the stage, or a change to it
    would not rerun the stage."""
    root = project
    env = {**project_env(root), "PYTHONPROFILEIMPORTTIME": "1"}
    command = ["dvc", "exp", "run", "-S", "select.max_ppl_increase=0.45", "-n", "budget-45"]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    ours = sorted(m for m in imported if m.split(".")[0] in {p.name for p in root.iterdir() if p.is_dir()})
    assert "flows.pipeline" in ours and "tasks.decide.gate" in ours and "tasks.report.run_report" in ours
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    deps = [Path(dep) for dep in stages["optimize"]["deps"]]
    for module in ours:
        path = Path(*module.split("."))
        assert any(dep == path or dep in path.parents for dep in deps), (
            f"{module} is not a dependency of optimize"
        )

    shown = csv.DictReader(io.StringIO(run(root, "dvc", "exp", "show", "--csv").stdout))
    row = next(r for r in shown if r["Experiment"] == "budget-45")
    assert row["select.max_ppl_increase"] == "0.45"
    assert float(row["onnx_int8.perplexity"]) > 1  # the experiment carries its metrics

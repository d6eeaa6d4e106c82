"""`llmopt search` end to end on a tiny project (real Prefect, MLflow, builds and engines): params.yaml's own
variants and the space's candidates proxied, raced against the leader, the record written and every trial a nested
MLflow run under one search run; a space's candidate equal to a params.yaml variant is raced once, as that variant;
a search killed midway resumes from its journal; a winner is registered from its trial's run for the gate."""

from __future__ import annotations

import json
import signal

import pytest

from tests.integration.project import make_project, run, tiny_params
from tests.integration.test_faults import finish, start

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_prefect")]
SEARCH = {
    "space": {"quantize": {"method": ["torchao_int8_weight_only", "torch_dynamic_int8"]}},
    "window_tokens": 16,
    "rounds": 2,
    "windows_per_round": 4,
    "pairs_per_round": 2,
    "confirm_pairs": 3,
    "confirm_windows": 4,
    "proxy_windows": 2,
    "decode_tokens": 8,
}


def test_search_races_the_candidates_and_records_every_trial(tmp_path, tiny_model_dir, corpus_dir):
    params = tiny_params(tiny_model_dir, corpus_dir, search=SEARCH)
    params["data"]["evaluation_passages"] = 8
    params["variants"] = {
        "baseline": {},
        "bf16": {"runtime": {"dtype": "bfloat16"}},
        "int8_dynamic": {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}]},
    }
    root = make_project(tmp_path / "project", params)
    # killed at its first speed pair (as by the OOM killer), then run again: it resumes from its journal
    process, log = start(root, "llmopt", "search", LLMOPT_FAILPOINT="search-pair:kill")
    code = finish(
        process
    )  # (what it left running, Prefect's server, its variants' processes, killed with it)
    assert code == -signal.SIGKILL, log.read_text(errors="replace")[-3000:]
    assert (root / ".llmopt" / "search" / "journal.json").exists()
    result = run(root, "llmopt", "search")
    out = result.stdout + result.stderr  # the table on stdout, the notes and the last line beside the log
    assert "resuming an interrupted search: 3 proxies" in out, out
    assert not (root / ".llmopt" / "search" / "journal.json").exists()  # finished: nothing to resume
    # (how many are raced depends on the proxies' timings: one may screen the other out as slower by over 10 %)
    assert "search: 2 proposed, 2 proxied" in out, out
    assert "params.yaml's int8_dynamic, raced as that" in out
    record = json.loads((root / ".llmopt" / "search" / "trials.json").read_text())
    trials = {trial["name"]: trial for trial in record["trials"]}
    assert len(trials) == 2 and record["counts"]["proposed"] == 2 and record["counts"]["raced"] >= 1
    # the leader is the faster of params.yaml's two on the proxies' decode; the other races with the candidate
    assert "quantize-torchao_int8_weight_only" in trials and len(set(trials) & {"bf16", "int8_dynamic"}) == 1
    for trial in trials.values():
        assert trial["stage"] in ("screened out", "dropped", "measured", "confirmed", "not confirmed"), trial
        assert trial["proxy"]["kl"] >= 0 and trial["proxy"]["stored_bytes"] > 0
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("llmopt")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("llmopt.kind") == "search"]
    nested = [r for r in runs if r.data.tags.get("llmopt.kind") == "search-trial"]
    assert sorted(p.info.status for p in parents) == ["FINISHED", "KILLED"]  # the killed one marked as such
    finished = next(p for p in parents if p.info.status == "FINISHED")
    assert sorted(r.data.tags["llmopt.variant"] for r in nested) == sorted(trials)
    assert all(r.data.tags["mlflow.parentRunId"] == finished.info.run_id for r in nested)
    assert all("proxy.kl" in r.data.metrics and r.data.tags["llmopt.search_stage"] for r in nested)
    # the registration a confirmed winner gets (which trial wins depends on this machine's timings: any one here)
    from flows.search import register_found
    from tasks.engines.manifest import read_manifest
    from tasks.params_file import load_config
    from tasks.report.tracking import configure_tracking

    config = load_config(root / "params.yaml")
    configure_tracking(config.tracking, root)
    trial = nested[0]
    name = trial.data.tags["llmopt.variant"]
    folder = root / ".llmopt" / "search" / "variants" / name
    registration = register_found(config, folder, read_manifest(folder), trial.info.run_id, "leader", "why")
    store = f"sqlite:///{root / 'mlflow.db'}"  # the registry named too: an earlier test may have set another
    version = mlflow.MlflowClient(store, registry_uri=store).get_model_version_by_alias(
        config.project.name, "candidate"
    )
    assert (registration.version, registration.reused) == (str(version.version), False)
    assert version.run_id == trial.info.run_id and version.tags["llmopt.source"] == "search"

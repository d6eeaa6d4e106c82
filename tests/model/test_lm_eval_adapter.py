"""The lm-evaluation-harness adapter answers through the Runtime, and a harness task runs end to end offline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tasks.config import VariantConfig
from tasks.hashing import folder_sha256
from tasks.lm_eval_tasks import continuation_loglikelihood, run_lm_eval, runtime_language_model
from tasks.load import BaseModel
from tasks.optimize import build_variant
from tasks.runtime import load_runtime

pytest.importorskip("lm_eval")  # a dev dependency; the adapter itself is optional for users


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    base = BaseModel(tiny_model_dir, folder_sha256(tiny_model_dir), "tiny")
    folder = tmp_path_factory.mktemp("harness") / "baseline"
    build_variant("baseline", VariantConfig(), base, "d", folder)
    return load_runtime(folder, threads=1)


def request(kind: str, *arguments):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)


def test_loglikelihood_is_the_runtime_score_of_the_continuation_and_greedy_is_checked(runtime):
    context, continuation = "The river walks the stone near the", " garden"
    model = runtime_language_model(runtime)
    ((logprob, greedy),) = model.loglikelihood([request("loglikelihood", context, continuation)])
    ctx, cont = runtime.encode(context), runtime.encode(continuation)
    ((whole, _),), ((head, _),) = runtime.score([ctx + cont]), runtime.score([ctx])
    assert logprob == pytest.approx(head - whole) and logprob < 0
    assert greedy == (runtime.generate([ctx], len(cont), stop_at_eos=False)[0] == cont)


def test_generate_until_stops_before_the_stop_string(runtime):
    model = runtime_language_model(runtime)
    full = model.generate_until([request("generate_until", "The river", {"max_gen_toks": 12})])[0]
    assert full and len(runtime.encode(full)) <= 12
    stop = full.strip()[:2]
    (cut,) = model.generate_until(
        [request("generate_until", "The river", {"until": [stop], "max_gen_toks": 12})]
    )
    assert stop not in cut and full.startswith(cut)


def test_a_harness_task_runs_end_to_end_on_local_data(runtime, tmp_path):
    rows = [{"context": "The river walks the", "target": " stone"} for _ in range(4)]
    data = tmp_path / "cloze.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    task = {
        "task": "tiny_cloze",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}",
        "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}],
    }
    results = run_lm_eval(runtime, [task], limit=None)
    logprob, greedy = continuation_loglikelihood(runtime, "The river walks the", " stone", [])
    assert set(results) == {"tiny_cloze.perplexity", "tiny_cloze.acc"}
    assert results["tiny_cloze.perplexity"] == pytest.approx(math.exp(-logprob), rel=1e-5)
    assert results["tiny_cloze.acc"] == float(greedy)

"""The lm-evaluation-harness adapter keeps the harness's contract: its loglikelihoods equal those of the harness's
own Hugging Face model class on the same model, and a harness task runs end to end offline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tasks.measure.lm_eval_adapter import continuation_loglikelihood, run_lm_eval, runtime_language_model

pytest.importorskip("lm_eval")  # a dev dependency; the adapter itself is optional for users

MAX_LENGTH = 24  # short windows, so rolling log-likelihoods need several (and a partial last one)
PAIRS = [
    ("The river walks the", " stone"),
    ("The river walks the ", "stone near the garden"),  # trailing space: moves into the continuation
    ("", "The train finds the book"),  # empty context: the prefix token stands in
    ("Near the garden 12, the", " teacher reads the letter."),
]
TEXT = "Near the garden 12, the river walks the stone. " * 6


def request(kind: str, *arguments):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)


@pytest.fixture(scope="module")
def harness_model(baseline_dir: Path):
    """lm-eval's own HFLM on the same weights: the reference the adapter must agree with."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=str(baseline_dir), backend="causal", max_length=MAX_LENGTH, batch_size=1, device="cpu"
    )


def test_loglikelihoods_equal_the_harness_hugging_face_model(baseline_runtime, harness_model):
    adapter = runtime_language_model(baseline_runtime, max_length=MAX_LENGTH)
    requests = [request("loglikelihood", *pair) for pair in PAIRS]
    ours, theirs = adapter.loglikelihood(requests), harness_model.loglikelihood(requests)
    for (logprob, greedy), (expected, expected_greedy) in zip(ours, theirs, strict=True):
        # the harness's transformers model and ours, float32 both: they differ in summation order only
        assert logprob == pytest.approx(expected, abs=1e-4) and logprob < 0
        assert greedy == expected_greedy


def test_rolling_loglikelihood_uses_the_harness_windows(baseline_runtime, harness_model):
    assert len(baseline_runtime.encode(TEXT)) > 3 * MAX_LENGTH  # several windows, the last one partial
    adapter = runtime_language_model(baseline_runtime, max_length=MAX_LENGTH)
    (ours,) = adapter.loglikelihood_rolling([request("loglikelihood_rolling", TEXT)])
    (theirs,) = harness_model.loglikelihood_rolling([request("loglikelihood_rolling", TEXT)])
    assert ours == pytest.approx(theirs, abs=1e-3)  # the same, summed over every window of a long text


def test_default_window_leaves_room_for_the_scored_token(baseline_runtime):
    assert runtime_language_model(baseline_runtime).max_length == baseline_runtime.context_length - 1


def test_generate_until_stops_before_the_stop_string(baseline_runtime):
    model = runtime_language_model(baseline_runtime)
    full = model.generate_until([request("generate_until", "The river", {"max_gen_toks": 12})])[0]
    assert full and len(baseline_runtime.encode(full)) <= 12
    stop = full.strip()[:2]
    (cut,) = model.generate_until(
        [request("generate_until", "The river", {"until": [stop], "max_gen_toks": 12})]
    )
    assert stop not in cut and full.startswith(cut)


def test_a_harness_task_runs_end_to_end_on_local_data(baseline_runtime, tmp_path):
    rows = [{"context": "The river walks the", "target": " stone"} for _ in range(4)]
    data = tmp_path / "cloze.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
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
    results = run_lm_eval(baseline_runtime, [task], limit=None)
    ids = baseline_runtime.encode("The river walks the stone")
    context = baseline_runtime.encode("The river walks the")
    logprob, greedy = continuation_loglikelihood(baseline_runtime, context, ids[len(context) :])
    assert set(results) == {"tiny_cloze.perplexity", "tiny_cloze.acc"}
    assert results["tiny_cloze.perplexity"] == pytest.approx(math.exp(-logprob), rel=1e-5)
    assert results["tiny_cloze.acc"] == float(greedy)

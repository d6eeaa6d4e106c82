"""The catalogue of bad input (docs/bad-input.md), run as a user meets it: `llmopt` on a project with one thing wrong gives
one clean line naming the culprit, the documented exit code, no traceback, and writes nothing at all."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.project import make_project, run, tiny_params


def registered_models(root: Path) -> int:
    database = root / "mlflow.db"
    if not database.exists():
        return 0
    with sqlite3.connect(database) as connection:
        return connection.execute("select count(*) from registered_models").fetchone()[0]


def run_failing(root: Path, *args: str) -> tuple[int, str]:
    result = run(root, "llmopt", *(args or ("run",)), check=False, timeout=600)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, output
    assert result.stderr.strip().splitlines()[-1] == error_lines[0], output  # the error is the last line
    return result.returncode, error_lines[0]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under the project (the linked code excepted) with its size and modification time."""
    entries = {}
    for folder, dirs, names in os.walk(root):  # does not follow the symlinked packages
        for name in names + dirs:
            path = Path(folder) / name
            if not path.is_symlink():
                stat = path.stat()
                entries[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return entries


@dataclass(frozen=True)
class Case:
    """One bad input: how to make it (from a valid params dict and the test's tmp folder), what the error line
    contains, the exit code, and the command (default `llmopt run`)."""

    spoil: Callable[[dict, Path], None]
    says: str
    code: int = 2
    args: tuple[str, ...] = ()
    params_text: str | None = None  # written verbatim instead of the params dict


def step_variant(*steps: dict, **runtime) -> Callable[[dict, Path], None]:
    def spoil(params: dict, _: Path) -> None:
        params["variants"]["v"] = {"steps": list(steps), **({"runtime": runtime} if runtime else {})}

    return spoil


def setting(section: str, **values) -> Callable[[dict, Path], None]:
    def spoil(params: dict, _: Path) -> None:
        params.setdefault(section, {}).update(values)

    return spoil


def spoilt_model(change: Callable[[Path], None]) -> Callable[[dict, Path], None]:
    """A copy of the tiny model with `change` applied, as model.source."""

    def spoil(params: dict, tmp: Path) -> None:
        model = Path(shutil.copytree(params["model"]["source"], tmp / "spoilt-model"))
        change(model)
        params["model"]["source"] = str(model)

    return spoil


def spoilt_corpus(files: dict[str, bytes]) -> Callable[[dict, Path], None]:
    def spoil(params: dict, tmp: Path) -> None:
        corpus = tmp / "spoilt-corpus"
        corpus.mkdir()
        for name, data in files.items():
            (corpus / name).write_bytes(data)
        params["data"]["source"] = str(corpus)

    return spoil


def jsonl_corpus(text: bytes) -> Callable[[dict, Path], None]:
    def spoil(params: dict, tmp: Path) -> None:
        (tmp / "corpus.jsonl").write_bytes(text)
        params["data"]["source"] = str(tmp / "corpus.jsonl")

    return spoil


def overwrite_header(model: Path) -> None:
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")  # a header length past the end of the file
    weights.write_bytes(bytes(data))


def unanswered_tracking(params: dict, _: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        params["tracking"] = {"uri": f"http://127.0.0.1:{probe.getsockname()[1]}"}


def unanswered_scheduler(params: dict, _: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        params["cluster"] = {"runner": "dask", "dask_address": f"tcp://127.0.0.1:{probe.getsockname()[1]}"}


CATALOGUE = {
    # params.yaml
    "unknown key": Case(
        setting("evaluate", windw=32), "evaluate.windw: unknown key (did you mean 'window'?)"
    ),
    "unknown key inside a step": Case(
        step_variant({"quantize": {"method": "torchao_int8_weight_only", "bitz": 8}}),
        "variants.v.steps[0].quantize.bitz: unknown key (did you mean 'bits'?)",
    ),
    "wrong type": Case(
        setting("benchmark", repeats="three"),
        "benchmark.repeats: Input should be a valid integer, got 'three'",
    ),
    "value out of bounds": Case(
        setting("select", max_ppl_increase=-0.1),
        "select.max_ppl_increase: Input should be greater than or equal to 0",
    ),
    "invalid YAML": Case(lambda p, t: None, "not valid YAML", params_text="variants: [\n"),
    "missing params file": Case(lambda p, t: None, "file not found", args=("run", "--params", "absent.yaml")),
    "baseline missing": Case(setting("select", baseline="nope"), "not in variants"),
    "baseline not plain fp32": Case(
        lambda p, t: p["variants"].update(baseline={"runtime": {"dtype": "bfloat16"}}),
        "must be fp32 with no steps",
    ),
    "a step naming two techniques": Case(
        step_variant({"quantize": {"method": "torch_dynamic_int8"}, "prune": {"method": "unstructured"}}),
        "exactly one technique",
    ),
    "onnx_genai not last": Case(
        step_variant({"onnx_genai": {}}, {"quantize": {"method": "torch_dynamic_int8"}}),
        "must be the last step",
    ),
    "onnx_genai after int8": Case(
        step_variant({"quantize": {"method": "torch_dynamic_int8"}}, {"onnx_genai": {}}),
        "exports a float model",
    ),
    "onnx_genai with bf16": Case(
        step_variant({"onnx_genai": {}}, dtype="bfloat16"), "sets its own precision"
    ),
    "onnx_genai block size the builder lacks": Case(
        step_variant({"onnx_genai": {"precision": "int4", "block_size": 48}}),
        "variants.v.steps[0].onnx_genai.block_size: Input should be 16, 32",
    ),
    "mixed precision on an int8 export": Case(
        step_variant({"onnx_genai": {"precision": "int8", "mixed_precision": {}}}),
        "mixed_precision applies to precision int4, not int8",
    ),
    "batch sizes without 1": Case(
        setting("benchmark", batch_sizes=[2, 4]), "benchmark: batch_sizes must include 1"
    ),
    "KV bits without a quantized KV cache": Case(
        step_variant(kv_cache_bits=2), "kv_cache_bits applies only with kv_cache: quantized"
    ),
    "eager attention on ONNX": Case(
        step_variant({"onnx_genai": {"precision": "int8"}}, attention="eager"),
        "runtime.attention applies to the torch engine",
    ),
    "sliding window below 8": Case(step_variant(sliding_window=4), "greater than or equal to 8"),
    "a setting of another quantization method": Case(
        step_variant({"quantize": {"method": "bnb_int8", "group_size": 64}}),
        "group_size applies to torchao_int4_weight_only / torchao_int4_tinygemm / torchao_int4_gptq / gptqmodel, "
        "not bnb_int8",
    ),
    "a step the target cannot run": Case(
        step_variant({"quantize": {"method": "gptqmodel", "group_size": 128}}),
        "gptqmodel does not run on cpu",
    ),
    "a cron Prefect would refuse": Case(
        setting("schedule", cron="61 * * * *"),
        "schedule.cron: '61 * * * *' is not a valid cron expression",
        args=("schedule", "--once"),
    ),
    "unsupported tracking scheme": Case(
        setting("tracking", uri="ftp://example.org/mlflow"), "tracking.uri: scheme ftp:// is not supported"
    ),
    "server-stored artifacts without a server": Case(
        setting("tracking", artifacts="mlflow-artifacts:/llmopt"),
        "tracking.artifacts: mlflow-artifacts:/ needs a tracking server",
    ),
    "tracking server not answering": Case(unanswered_tracking, "tracking.uri: nothing answers at 127.0.0.1:"),
    "Dask scheduler not answering": Case(
        unanswered_scheduler, "cluster.dask_address: nothing answers at tcp://127.0.0.1:"
    ),
    "bad --concurrency": Case(
        lambda p, t: None,
        "--concurrency: comma-separated positive integers",
        args=("loadtest", "--concurrency", "0,x"),
    ),
    "bad --prompt-words": Case(
        lambda p, t: None,
        "--prompt-words: a positive integer N or LOW,HIGH with LOW <= HIGH",
        args=("loadtest", "--prompt-words", "64,8"),
    ),
    # files: the model, the corpus
    "model folder missing": Case(
        lambda p, t: p["model"].update(source=str(t / "no-such-model")), "local model folder", code=2
    ),
    "model folder without config.json": Case(
        spoilt_model(lambda m: (m / "config.json").unlink()),
        "has no config.json; expected a Hugging Face model folder",
    ),
    "model config.json not JSON": Case(
        spoilt_model(lambda m: (m / "config.json").write_text("{'not': json")),
        "config.json is not valid JSON",
    ),
    "model weights with a damaged header": Case(
        spoilt_model(overwrite_header), "is not a readable safetensors file"
    ),
    "model folder without weights": Case(
        spoilt_model(lambda m: (m / "model.safetensors").unlink()),
        "holds no weights (*.safetensors or *.bin)",
    ),
    "corpus missing": Case(lambda p, t: p["data"].update(source=str(t / "no-such-corpus")), "does not exist"),
    "corpus folder without text files": Case(
        spoilt_corpus({"notes.pdf": b"%PDF-1.4"}), "holds no text files"
    ),
    "corpus file not UTF-8": Case(
        spoilt_corpus({"a.txt": b"fine text\n", "b.txt": b"caf\xe9 latin-1"}),
        "b.txt is not UTF-8 text (byte 0xe9",
    ),
    "corpus JSONL with a broken line": Case(
        jsonl_corpus(b'{"text": "one passage"}\n{"text": broken\n'), "corpus.jsonl line 2 is not JSON"
    ),
    "corpus JSONL without the text column": Case(
        jsonl_corpus(b'{"text": "one passage"}\n{"body": "another"}\n'),
        "corpus.jsonl line 2 has no 'text' field",
        code=2,
    ),
}


@pytest.mark.parametrize("case", CATALOGUE.values(), ids=CATALOGUE.keys())
def test_bad_input_gives_one_line_its_exit_code_and_writes_nothing(
    case, tmp_path, tiny_model_dir, corpus_dir
):
    params = tiny_params(tiny_model_dir, corpus_dir)
    case.spoil(params, tmp_path)
    root = make_project(tmp_path / "p", params, with_dvc=False)
    if case.params_text is not None:
        (root / "params.yaml").write_text(case.params_text)
    before = snapshot(root)
    code, line = run_failing(root, *case.args)
    assert case.says in line
    assert code == case.code
    assert snapshot(root) == before, "a refused command wrote into the project"


def test_every_pre_flight_problem_is_named_at_once_before_anything_starts(tmp_path, tiny_model_dir):
    params = tiny_params(
        tiny_model_dir, tmp_path / "no-such-corpus", tracking={"uri": "ftp://example.org/mlflow"}
    )
    root = make_project(tmp_path / "p", params, with_dvc=True)
    run(root, "dvc", "remote", "default", "--unset")
    before = snapshot(root)
    code, line = run_failing(root)
    assert code == 2 and "3 problems, nothing started" in line
    assert f"data.source: {tmp_path / 'no-such-corpus'} does not exist" in line
    assert "tracking.uri: scheme ftp:// is not supported" in line and "DVC: no default remote" in line
    assert snapshot(root) == before


@pytest.mark.slow
@pytest.mark.usefixtures("shared_prefect")
def test_a_corpus_too_short_for_its_splits_stops_before_anything_is_registered(tmp_path, tiny_model_dir):
    short = tmp_path / "short-corpus"
    short.mkdir()
    (short / "one.txt").write_text("A single short line.\n")
    root = make_project(tmp_path / "p", tiny_params(tiny_model_dir, short), with_dvc=False)
    code, line = run_failing(root)
    assert code == 1
    assert "data validation failed: corpus-calibration: expect_table_row_count_to_be_between" in line
    assert registered_models(root) == 0
    assert not (root / ".llmopt" / "variants").exists()

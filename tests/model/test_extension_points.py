"""Every extension point takes a newcomer from outside the package with one registration each: a toy quantization
method that writes a toy weights format, a toy engine with its export technique, and a toy wire API, all in one
plug-in module named in $LLMOPT_TECHNIQUES, go through validation, the build, the manifest, loading, serving and
the docs' technique table without a change to any llmopt module."""

from __future__ import annotations

from tests.factories import run_with_plugin

TOYS = '''
"""Toys for every extension point."""

import json
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from serving.api.common import state_of
from serving.api.registry import WireApi, register_api
from tasks.engines.contract import BatchDecoder, Runtime
from tasks.engines.registry import register_engine
from tasks.schema import Strict
from tasks.techniques.quantize.methods import QuantMethod, Quantized, register_method
from tasks.techniques.registry import Exported, Row, Technique, register
from tasks.weights.registry import WeightsFormat
from tasks.weights.registry import register as register_format

# --- a weights format: float16 safetensors and a marker file, loaded back as float32 ---------------------------


@register_format
class Halves(WeightsFormat):
    name = "toy-halves"

    def save(self, model, dest, dtype, record):
        import torch

        model.to(torch.float16).save_pretrained(dest)
        (dest / "toy-halves.json").write_text(json.dumps(record))

    def load(self, folder, dtype, settings, target):
        import torch
        from transformers import AutoModelForCausalLM

        json.loads((folder / "toy-halves.json").read_text())
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(target.device)


# --- a quantization method writing it ----------------------------------------------------------------------------


def to_halves(model, settings, calibration, progress):
    return Quantized(model, "toy-halves", {"method": settings.method})


register_method(
    QuantMethod(
        "toy_halves",
        "weights rounded to float16 (a toy)",
        16,
        to_halves,
        rows=(Row("`quantize: {method: toy_halves}`", (), "float16 weights in a format of its own (a toy)"),),
    )
)

# --- an engine and its export technique: the next token is the last one plus `shift` ---------------------------


class BigramStep(Strict):
    """A bigram engine: the next token is the last one plus `shift` (a toy)."""

    shift: Annotated[int, Field(ge=1)] = 1


@register
class BigramExport(Technique):
    name = "toy_bigram"
    settings = BigramStep
    role = "export"
    engine_label = "the toy bigram engine"

    def needs_model(self, settings):
        return False

    def export(self, model, settings, job):
        vocabulary = len(job.context.tokenizer)
        (job.dest / "bigram.json").write_text(json.dumps({"shift": settings.shift, "vocabulary": vocabulary}))
        return Exported("bigram-json", "toy-bigram", [f"shift {settings.shift}"], parameters=1)

    def rows(self):
        return [Row("`toy_bigram`", ("shift",), "a bigram engine (a toy)")]


@register_engine
class BigramRuntime(Runtime):
    ENGINE = "toy-bigram"
    LIBRARIES = ("numpy",)

    def __init__(self, folder, manifest, target):
        from transformers import AutoTokenizer

        self.manifest, self.tokenizer, self.context_length = manifest, AutoTokenizer.from_pretrained(folder), 4096
        table = json.loads((folder / "bigram.json").read_text())
        self.shift, self.vocabulary = table["shift"], table["vocabulary"]

    def logits(self, last):
        row = np.full(self.vocabulary, -10.0, dtype=np.float32)
        row[(last + self.shift) % self.vocabulary] = 10.0
        return row

    def score(self, sequences):
        from tasks.engines.contract import next_token_nll

        return [next_token_nll(np.stack([self.logits(t) for t in ids]), ids) for ids in sequences]

    def _generate_batch(self, batch, max_new_tokens, stop_at_eos):
        rows = []
        for prompt in batch:
            row = [prompt[-1]]
            for _ in range(max_new_tokens):
                row.append(int(self.logits(row[-1]).argmax()))
            rows.append(row[1:])
        return rows

    def batch_decoder(self):
        return BigramDecoder(self)


class BigramDecoder(BatchDecoder):
    def __init__(self, runtime):
        self.runtime, self.sequences, self.count = runtime, {}, 0

    def add(self, prompt):
        self.count += 1
        self.sequences[self.count] = prompt[-1]
        return self.count, self.runtime.logits(prompt[-1])

    def step(self, tokens):
        self.sequences.update(tokens)
        return {sequence: self.runtime.logits(token) for sequence, token in tokens.items()}

    def remove(self, sequence):
        self.sequences.pop(sequence, None)

    @property
    def active(self):
        return len(self.sequences)


# --- a wire API: the served variant, and errors in a shape of its own ----------------------------------------------

router = APIRouter()


@router.get("/toy/variant")
def variant(http: Request) -> dict:
    served = state_of(http).model_router.models[0]
    return {"engine": served.current.runtime.manifest.engine, "variant": served.current.runtime.manifest.name}


@router.post("/toy/count")
def count(body: BigramStep) -> dict:
    return {"shift": body.shift}


register_api(WireApi("toy", router, lambda status, message, kind: {"toy_error": message}, frozenset({"/toy/count"})))
'''

SCRIPT = """
import json, sys
from pathlib import Path

import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from serving.app import create_app
from serving.models import Limits, LoadedModel, ModelRouter, ServedModel
from tasks.config import ServeConfig, TargetConfig
from tasks.engines import load_runtime
from tasks.inputs.load import PreparedBase
from tasks.local_files import folder_sha256
from tasks.params import VariantConfig
from tasks.report.tracking import recipe_params
from tasks.techniques.build import _library_versions, build_variant
from tasks.techniques.registry import technique_table

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
base = PreparedBase(model_dir, folder_sha256(model_dir), "tiny")
result = {}
for name, steps in (
    ("unknown", [{"quantize": {"method": "toy_halvez"}}]),
    ("foreign", [{"quantize": {"method": "toy_halves", "group_size": 64}}]),
    ("shift", [{"toy_bigram": {"shift": 0}}]),
):
    try:
        VariantConfig.model_validate({"steps": steps})
    except Exception as exc:
        result[name] = str(exc)

# the method and its format: build, manifest, load, generate
halves = build_variant(
    "halves", VariantConfig.model_validate({"steps": [{"quantize": {"method": "toy_halves"}}]}), base, "d", out / "h"
)
result["halves"] = {"format": halves.weights_format, "engine": halves.engine, "notes": halves.notes}
result["halves_params"] = {k: v for k, v in recipe_params(halves).items() if k in ("technique", "weight_bits")}
runtime = load_runtime(out / "h", TargetConfig(threads=1))
stored = load_file(model_dir / "model.safetensors")
loaded = dict(runtime.model.named_parameters())
result["halves_weights"] = all(
    torch.equal(loaded[n].data, stored[n].half().float()) for n in stored if n in loaded
) and runtime.model.dtype == torch.float32
result["halves_generate"] = len(runtime.generate([[5, 6, 7]], 3, stop_at_eos=False)[0])

# the engine and its export: build, manifest, load, generate, serve
bigram = build_variant(
    "bigram", VariantConfig.model_validate({"steps": [{"toy_bigram": {"shift": 3}}]}), base, "d", out / "b"
)
result["bigram"] = {"format": bigram.weights_format, "engine": bigram.engine, "notes": bigram.notes}
runtime = load_runtime(out / "b", TargetConfig(threads=1))
result["engine_class"] = type(runtime).__name__
result["generate"] = runtime.generate([[5, 6]], 3, stop_at_eos=False)
result["versions"] = "numpy" in _library_versions()
settings = ServeConfig(max_new_tokens=4)
served = ServedModel("tiny", None, LoadedModel("1", runtime, Limits.of(settings).scheduler(runtime, None)))
with TestClient(create_app(ModelRouter([served]), settings)) as client:
    prompt = runtime.decode([5, 6])
    answer = client.post("/v1/completions", json={"model": "tiny/1", "prompt": prompt, "max_tokens": 3,
                                                   "temperature": 0, "ignore_eos": True})
    body = answer.json()
    result["served"] = [answer.status_code, body["choices"][0]["text"] if answer.status_code == 200 else body]
    result["expected_text"] = runtime.decode(runtime.generate([runtime.encode(prompt)], 3, stop_at_eos=False)[0])
    result["toy_api"] = client.get("/toy/variant").json()
    refused = client.post("/toy/count", json={"shift": 0})
    result["toy_error"] = [refused.status_code, sorted(refused.json())]
    refused = client.post("/v1/completions", json={"model": "tiny/1"})
    result["openai_error"] = [refused.status_code, sorted(refused.json())]
result["table"] = [line for line in technique_table().splitlines() if "toy" in line]
print(json.dumps(result))
"""


def test_toys_of_every_kind_plug_in_with_one_registration_each(tiny_model_dir, tmp_path):
    result = run_with_plugin(tmp_path, "toy_plugins", TOYS, SCRIPT, str(tiny_model_dir), str(tmp_path))
    # validation: the method is one of the step's methods, with the step's rules; the export's settings are checked
    assert "Input should be" in result["unknown"] and "'toy_halves'" in result["unknown"], result["unknown"]
    assert "group_size applies to" in result["foreign"] and "not toy_halves" in result["foreign"]
    assert "toy_bigram.shift" in result["shift"] and "greater than or equal to 1" in result["shift"]
    # the method's format: written by the build, recorded in the manifest, read back by the torch engine
    assert result["halves"] == {
        "format": "toy-halves",
        "engine": "torch",
        "notes": ["weights rounded to float16 (a toy)"],
    }
    assert result["halves_params"] == {"technique": "quantize", "weight_bits": 16}
    assert result["halves_weights"] is True
    assert result["halves_generate"] == 3
    # the engine: its export builds the variant, load_runtime opens it with the registered class, the server serves it
    assert result["bigram"] == {"format": "bigram-json", "engine": "toy-bigram", "notes": ["shift 3"]}
    assert result["engine_class"] == "BigramRuntime"
    assert result["generate"] == [[9, 12, 15]]
    assert result["versions"] is True  # its LIBRARIES enter the build key
    assert result["served"] == [200, result["expected_text"]]
    # the wire API: its routes are served, its errors take its own shape; OpenAI's keep theirs
    assert result["toy_api"] == {"engine": "toy-bigram", "variant": "bigram"}
    assert result["toy_error"] == [422, ["toy_error"]]
    assert result["openai_error"] == [422, ["error"]]
    # the docs table lists the method and the export
    assert result["table"] == [
        "| `quantize: {method: toy_halves}` | — | float16 weights in a format of its own (a toy) |",
        "| `toy_bigram` | `shift: 1` | a bigram engine (a toy) |",
    ]

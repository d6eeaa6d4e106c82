"""Techniques are plugins: a toy technique, in one module outside llmopt, registered through $LLMOPT_TECHNIQUES,
goes through config validation, the target check, the build, the manifest and the report's params without a
change to any other module; and every table that names techniques is derived from the registry."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tasks import plugins
from tasks.params import Step, VariantConfig
from tasks.techniques import registry
from tests.factories import run_with_plugin

REPO = Path(__file__).resolve().parents[2]

TOY = '''
"""A toy technique: scale every RMSNorm weight by `factor` (a transform, so it composes before quantize)."""

from typing import Annotated, Any

from pydantic import Field

from tasks.schema import Strict
from tasks.techniques.registry import Applied, Row, Technique, register


class ScaleNormsStep(Strict):
    """Every RMSNorm weight times `factor`."""

    factor: Annotated[float, Field(gt=0.0)] = 2.0


@register
class ScaleNorms(Technique):
    name = "scale_norms"
    settings = ScaleNormsStep
    role = "transform"

    def apply(self, model: Any, settings: ScaleNormsStep, context: Any) -> Applied:
        import torch

        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.mul_(settings.factor)
        return Applied(model, "hf-safetensors", f"norms scaled by {settings.factor}")

    def weight_bits(self, settings: ScaleNormsStep, manifest: Any) -> int | None:
        return 32

    def problems(self, where: str, settings: ScaleNormsStep, config: Any, cuda_available: bool) -> list[str]:
        return [f"{where}.factor: {settings.factor} is too much for a toy"] if settings.factor > 10 else []

    def rows(self) -> list[Row]:
        return [Row("`scale_norms`", ("factor",), "scales the RMSNorm weights (a toy)")]
'''

SCRIPT = """
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tasks.params import VariantConfig
from tasks.params_file import load_config
from tasks.errors import ConfigError
from tasks.inputs.load import PreparedBase
from tasks.report.tracking import recipe_params
from tasks.local_files import folder_sha256
from tasks.targets import target_problems
from tasks.techniques.build import build_variant
from tasks.techniques.registry import technique_table

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {}
try:
    VariantConfig.model_validate({"steps": [{"scale_norms": {"factr": 2.0}}]})
except Exception as exc:
    result["typo"] = str(exc).splitlines()[1:3]
try:
    VariantConfig.model_validate(
        {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}, {"scale_norms": {}}]}
    )
except Exception as exc:
    result["order"] = str(exc)
variant = VariantConfig.model_validate(
    {"steps": [{"scale_norms": {"factor": 3.0}}, {"quantize": {"method": "torch_dynamic_int8"}}]}
)
(out / "params.yaml").write_text(
    "variants:\\n  baseline: {}\\n  toy:\\n    steps:\\n      - scale_norms: {factor: 11.0}\\n"
)
try:
    result["target"] = target_problems(load_config(out / "params.yaml"), cuda_available=False)
except ConfigError as exc:
    result["target"] = [str(exc)]
plain = VariantConfig.model_validate({"steps": [{"scale_norms": {"factor": 3.0}}]})
manifest = build_variant("toy", plain, PreparedBase(model_dir, folder_sha256(model_dir), "tiny"), "d", out / "toy")
before, after = load_file(model_dir / "model.safetensors"), load_file(out / "toy" / "model.safetensors")
norms = [name for name in before if name.endswith("norm.weight")]
result["scaled"] = all(torch.allclose(after[name], 3.0 * before[name]) for name in norms) and bool(norms)
result["others_unchanged"] = all(torch.equal(after[n], before[n]) for n in before if n not in norms and n in after)
result["notes"] = manifest.notes
result["recipe"] = manifest.recipe
result["composed_recipe"] = variant.recipe()
result["params"] = {k: v for k, v in recipe_params(manifest).items() if k in ("technique", "weight_bits", "scale_norms.factor")}
result["table"] = [line for line in technique_table().splitlines() if "scale_norms" in line]
print(json.dumps(result))
"""


def test_a_toy_technique_in_its_own_module_runs_through_validation_build_manifest_and_report(
    tiny_model_dir, tmp_path
):
    result = run_with_plugin(tmp_path, "toy_technique", TOY, SCRIPT, str(tiny_model_dir), str(tmp_path))
    assert "scale_norms.factr" in " ".join(result["typo"]), result["typo"]  # the schema knows its settings
    # the order rules know its role: a transform works on float weights
    assert "prune, distill and scale_norms work on float weights; put them before quantize" in result["order"]
    assert result["target"] == ["variants.toy.steps[0].scale_norms.factor: 11.0 is too much for a toy"]
    assert result["scaled"] and result["others_unchanged"]
    assert result["notes"] == ["norms scaled by 3.0"]
    assert result["recipe"]["steps"] == [{"scale_norms": {"factor": 3.0}}]
    assert result["composed_recipe"]["steps"][0] == {"scale_norms": {"factor": 3.0}}
    assert result["params"] == {"technique": "scale_norms", "weight_bits": 32, "scale_norms.factor": 3.0}
    assert result["table"] == ["| `scale_norms` | `factor: 2` | scales the RMSNorm weights (a toy) |"]


def test_a_technique_module_that_cannot_be_imported_is_one_line_naming_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), plugins.ENVIRONMENT: "no_such_technique"}
    command = [str(Path(sys.executable).parent / "llmopt"), "run"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "$LLMOPT_TECHNIQUES: technique module no_such_technique cannot be imported" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_schema_target_checks_report_bits_and_docs_table_all_come_from_the_registry():
    assert list(Step.model_fields) == list(registry.TECHNIQUES)  # one field per technique, in registry order
    for name, entry in registry.TECHNIQUES.items():
        assert Step.model_fields[name].annotation == entry.settings | None
    page = (REPO / "docs" / "techniques.md").read_text()  # `make techniques-table` writes it
    start, end = "<!-- techniques: generated by `make techniques-table` -->", "<!-- /techniques -->"
    assert page[page.index(start) + len(start) : page.index(end)].strip() == registry.technique_table()
    for module in (
        "tasks/targets.py",
        "tasks/report/tracking.py",
        "tasks/decide/model_registry.py",
        "tasks/config.py",
        "tasks/params.py",
        "tasks/techniques/catalog.py",
    ):
        source = (REPO / module).read_text()
        for method in ("torchao_int8", "bnb_nf4", "Q4_K_M", "gptq"):  # no second table of techniques
            assert method not in source, f"{module} names {method}: derive it from the registry"


def test_every_built_in_technique_states_its_role_and_a_step_reaches_its_settings():
    assert {entry.role for entry in registry.TECHNIQUES.values()} == {"transform", "quantize", "export"}
    step = VariantConfig.model_validate({"steps": [{"onnx_genai": {"precision": "int8"}}]}).steps[0]
    assert step.kind == "onnx_genai" and step.settings.precision == "int8" and step.technique.role == "export"
    assert textwrap.dedent(registry.technique_table()).count("\n") >= len(registry.TECHNIQUES) + 1

"""dvc.yaml names only parameters params.yaml holds: `dvc repro` (what `make run` does) refuses a stage whose
parameter is missing from the file, even when the configuration has a default for it."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_every_parameter_dvc_yaml_names_is_in_params_yaml():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    missing = []
    for name, stage in stages.items():
        for entry in stage.get("params", []):
            for key in entry if isinstance(entry, dict) else [entry]:
                node = params
                for part in key.split("."):
                    if not isinstance(node, dict) or part not in node:
                        missing.append(f"{name}: {key}")
                        break
                    node = node[part]
    assert not missing, f"dvc.yaml names parameters params.yaml lacks: {missing}"

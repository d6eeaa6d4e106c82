"""MLflow params of a variant's recipe: flat, comparable keys (no MLflow here: tracking.py logs them)."""

from __future__ import annotations

import json
from typing import Any

from tasks.engines.manifest import VariantManifest
from tasks.techniques import registry


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: MLflow params are flat."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


def recipe_params(manifest: VariantManifest) -> dict[str, Any]:
    """The recipe as flat, comparable MLflow params: the technique family, the weight precision in bits, every
    step setting as `<step>.<setting>` and the resolved runtime settings as `runtime.<setting>` (so the compare
    view can plot block size or precision against speed), plus the engine, format, hash and the recipe itself."""
    steps = manifest.recipe.get("steps", [])
    params: dict[str, Any] = {
        "technique": "+".join(next(iter(step)) for step in steps) or "runtime",
        "weight_bits": _DTYPE_BITS.get(manifest.dtype, 32),
        "dtype": manifest.dtype,
        "engine": manifest.engine,
        "weights_format": manifest.weights_format,
        "recipe_hash": manifest.recipe_hash,
        "recipe": json.dumps(manifest.recipe, sort_keys=True),
    }
    for step in steps:
        ((name, settings),) = step.items()
        params.update(flatten(settings, f"{name}."))
        read = registry.recorded_settings(name, settings)  # None: a step this version cannot read: no bits
        bits = read[0].weight_bits(read[1], manifest) if read else None
        params["weight_bits"] = bits or params["weight_bits"]
    params.update(flatten(manifest.runtime_settings().model_dump(mode="json"), "runtime."))
    return params

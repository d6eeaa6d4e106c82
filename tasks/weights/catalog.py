"""Which weights formats exist: the built-in format modules and the plug-ins (tasks/plugins.py), imported so that
each registers itself with tasks/weights/registry.py. The torch engine looks formats up here."""

from __future__ import annotations

import importlib
from pathlib import Path

from tasks.errors import ArtifactError
from tasks.plugins import load_plugins
from tasks.weights.registry import FORMATS, WeightsFormat

# Modules under tasks.weights that register the built-in formats.
BUILT_IN = ("safetensors", "torch_dynamic", "transformers_quantized", "quanto", "on_load")


def load() -> dict[str, WeightsFormat]:
    """Import the built-in formats, then the plug-ins; returns the registry."""
    for module in BUILT_IN:
        importlib.import_module(f"tasks.weights.{module}")
    load_plugins()
    return FORMATS


def weights_format(name: str, folder: Path) -> WeightsFormat:
    """The registered format `name` of the variant in `folder` (an ArtifactError naming the known ones if none)."""
    formats = load()
    if name not in formats:
        raise ArtifactError(f"{folder}: weights format {name!r} unknown; known: {', '.join(formats)}")
    return formats[name]

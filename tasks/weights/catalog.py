"""Which weights formats exist: the built-in format modules and the plug-ins (tasks/plugins.py), imported so that
each registers itself with tasks/weights/registry.py. The torch engine looks formats up here."""

from __future__ import annotations

from pathlib import Path

from tasks.errors import ArtifactError
from tasks.plugins import load_with_plugins
from tasks.weights.registry import FORMATS, WeightsFormat

# Modules under tasks.weights that register the built-in formats.
BUILT_IN = ("safetensors", "torch_dynamic", "transformers_quantized", "quanto", "on_load")


def load() -> dict[str, WeightsFormat]:
    """Import the built-in formats, then the plug-ins; returns the registry."""
    load_with_plugins(f"tasks.weights.{module}" for module in BUILT_IN)
    return FORMATS


def weights_format(name: str, folder: Path) -> WeightsFormat:
    """The registered format `name` of the variant in `folder` (an ArtifactError naming the known ones if none)."""
    formats = load()
    if name not in formats:
        raise ArtifactError(f"{folder}: weights format {name!r} unknown; known: {', '.join(formats)}")
    return formats[name]

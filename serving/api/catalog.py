"""Which wire APIs the server speaks: the built-in API modules and the plug-ins (tasks/plugins.py), imported so that
each registers itself with serving/api/registry.py."""

from __future__ import annotations

from serving.api.registry import APIS, WireApi
from tasks.plugins import load_with_plugins

# Modules under serving.api that register the built-in APIs (OpenAI's is the default error shape).
BUILT_IN = ("openai", "tgi")


def load() -> dict[str, WireApi]:
    """Import the built-in APIs, then the plug-ins; returns the registry."""
    load_with_plugins(f"serving.api.{module}" for module in BUILT_IN)
    return APIS

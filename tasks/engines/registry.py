"""The engine registry: every engine is a `Runtime` subclass (tasks/engines/contract.py) decorated with
`@register_engine`, under the name a variant's manifest records as its `engine`. `load_runtime` opens a variant with
the engine registered under that name; the build key includes the versions of every registered engine's
`LIBRARIES`.

Adding an engine is one module (or package) under tasks/engines/ with its runtime and, if it has one, its export
technique, and one name in tasks/engines/__init__.py's `BUILT_IN`, or a plug-in module (tasks/plugins.py)."""

from __future__ import annotations

from tasks.engines.contract import Runtime

ENGINES: dict[str, type[Runtime]] = {}

# Modules only the server's batch decoders run (and the benchmark's served replay, measured afresh every run): no
# build writes bytes with them and no evaluation runs them, so the build and evaluation keys leave them out, and a
# change to how the server batches rebuilds and re-evaluates nothing (it rebuilt and re-evaluated every variant)
SERVING_ONLY = (
    "tasks.engines.llama_cpp.batch",
    "tasks.engines.onnx.batch",
    "tasks.engines.onnx.bf16_prompts",
    "tasks.engines.onnx.float_prompts",
    "tasks.engines.onnx.graph_weights",
    "tasks.engines.pytorch.graph_slots",
    "tasks.engines.pytorch.slots",
)


def register_engine(cls: type[Runtime]) -> type[Runtime]:
    """Class decorator: the engine `cls.ENGINE` is `cls` (a second class of the same name is an error)."""
    if cls.ENGINE in ENGINES and ENGINES[cls.ENGINE] is not cls:
        raise ValueError(f"engine {cls.ENGINE!r} is registered twice")
    ENGINES[cls.ENGINE] = cls
    return cls


def engine_libraries() -> list[str]:
    """The pip distributions every registered engine runs on, for the build key."""
    return sorted({library for engine in ENGINES.values() for library in engine.LIBRARIES})

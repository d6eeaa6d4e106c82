"""The engine registry: every engine is a `Runtime` subclass (tasks/engines/contract.py) decorated with
`@register_engine`, under the name a variant's manifest records as its `engine`. `load_runtime` opens a variant with
the engine registered under that name; the build key includes the versions of every registered engine's
`LIBRARIES`.

Adding an engine is one module (or package) under tasks/engines/ with its runtime and, if it has one, its export
technique, and one name in tasks/engines/__init__.py's `BUILT_IN`, or a plug-in module (tasks/plugins.py)."""

from __future__ import annotations

from tasks.engines.contract import Runtime

ENGINES: dict[str, type[Runtime]] = {}


def register_engine(cls: type[Runtime]) -> type[Runtime]:
    """Class decorator: the engine `cls.ENGINE` is `cls` (a second class of the same name is an error)."""
    if cls.ENGINE in ENGINES and ENGINES[cls.ENGINE] is not cls:
        raise ValueError(f"engine {cls.ENGINE!r} is registered twice")
    ENGINES[cls.ENGINE] = cls
    return cls


def engine_libraries() -> list[str]:
    """The pip distributions every registered engine runs on, for the build key."""
    return sorted({library for engine in ENGINES.values() for library in engine.LIBRARIES})

"""The base of every settings model: strict, frozen, and recorded into recipes as the user wrote them.

Lives apart from tasks.config so that a technique module declares its own settings without importing the whole
configuration (tasks.config builds its recipe step schema from the technique registry)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

Dtype = Literal["float32", "bfloat16", "float16"]


class Strict(BaseModel):
    """Base for every config section: unknown keys are refused, values are not coerced across types.

    Every default is declared here, once, on its field; code reads the field and never supplies a fallback.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    # Recipe sections only: fields written into the recipe (and its hash) even when left at their default. Every
    # other field enters the recipe only when params.yaml sets it, so a new setting (or a default made explicit
    # in code) changes no existing recipe hash. These lists are frozen: recipe hashes recorded in MLflow and the
    # registry depend on them.
    RECORDED_DEFAULTS: ClassVar[frozenset[str]] = frozenset()

    def recipe_data(self) -> dict[str, Any]:
        """What the user wrote in this section (plus its recorded defaults), as plain JSON data."""
        names = [n for n in type(self).model_fields if n in self.model_fields_set | self.RECORDED_DEFAULTS]
        return {name: _plain(getattr(self, name)) for name in names if getattr(self, name) is not None}


def _plain(value: Any) -> Any:
    if isinstance(value, Strict):
        return value.recipe_data()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value

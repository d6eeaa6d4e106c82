"""The base of every settings model: strict, frozen, and recorded into recipes as the user wrote them.

Lives apart from tasks.config so that a technique module declares its own settings without importing the whole
configuration (tasks.params builds the recipe step schema from the registered techniques)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class Former:
    """A setting's former spelling, still read: the setting's name now, its former values mapped to today's, and
    former values that are refused (value → the one-line reason)."""

    name: str
    values: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


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
    # Renamed settings: former key → the setting now (a renamed value keeps its key). Read silently here;
    # tasks.params_file tells the user about each one params.yaml still spells the former way.
    FORMER: ClassVar[dict[str, Former]] = {}

    @model_validator(mode="before")
    @classmethod
    def _former_spellings(cls, data: Any) -> Any:
        if not cls.FORMER or not isinstance(data, dict):
            return data
        data = dict(data)
        for old, former in cls.FORMER.items():
            if old not in data:
                continue
            if old != former.name and former.name in data:
                raise ValueError(f"{old} is the former name of {former.name}; set only {former.name}")
            value = data.pop(old)
            if isinstance(value, str) and value in former.refused:
                raise ValueError(f"{old}: {value} {former.refused[value]}")
            data[former.name] = former.values.get(value, value) if isinstance(value, str) else value
        return data

    @classmethod
    def former_spellings(cls, data: Any) -> list[str]:
        """'old: value → new: value' for each setting `data` (as written) spells the former way."""
        found = []
        for old, former in cls.FORMER.items() if isinstance(data, dict) else ():
            value = data.get(old)
            now = former.values.get(value, value) if isinstance(value, str) else value
            if old in data and (old != former.name or now != value):
                found.append(f"{old}: {value} → {former.name}: {now}")
        return found

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

"""The recipe search's space as a user writes it (params.yaml's `search.space`): per technique, each setting a list
of choices; the candidates are every combination, each a one-step variant recipe validated exactly as a
`variants:` entry is. A key that is not a setting of its technique, or a value its setting refuses, is a
ConfigError naming `search.space.<technique>.<setting>`; a combination the technique refuses as a whole (two
settings that do not go together) is left out and counted. `variant_block` writes a candidate out as the
`variants:` entry a user can keep in params.yaml."""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from tasks.errors import ConfigError
from tasks.params import VariantConfig
from tasks.techniques import catalog

SOURCE = "search.space"


@dataclass(frozen=True)
class Candidate:
    """One combination: its name (from its choices, readable in the MLflow UI), the choices, the variant recipe."""

    name: str
    technique: str
    choices: dict[str, Any]
    variant: VariantConfig


@dataclass(frozen=True)
class Space:
    """The candidates of a space, and per technique how many of its combinations it refused (with one reason)."""

    candidates: list[Candidate]
    refused: dict[str, tuple[int, str]] = field(default_factory=dict)


def expand(space: dict[str, dict[str, list[Any]]]) -> Space:
    """Every combination of every technique's choices as a validated candidate (see the module's docstring)."""
    if not isinstance(space, dict) or not space:
        raise ConfigError(
            f"{SOURCE}: a mapping of technique → {{setting: [choices]}}, at least one technique"
        )
    techniques = catalog.load()
    candidates, refused = [], {}
    for technique, settings in space.items():
        if technique not in techniques:
            raise ConfigError(f"{SOURCE}.{technique}: not a technique{_hint(technique, list(techniques))}")
        fields = list(techniques[technique].settings.model_fields)
        if not isinstance(settings, dict) or not settings:
            raise ConfigError(f"{SOURCE}.{technique}: a mapping of setting → [choices], at least one setting")
        for key, choices in settings.items():
            if key not in fields:
                raise ConfigError(
                    f"{SOURCE}.{technique}.{key}: not a setting of {technique}{_hint(key, fields)}"
                )
            if not isinstance(choices, list) or not choices:
                raise ConfigError(
                    f"{SOURCE}.{technique}.{key}: a list of choices, at least one, got {choices!r}"
                )
        count, reason = 0, ""
        for values in itertools.product(*settings.values()):
            choices = dict(zip(settings, values, strict=True))
            try:
                variant = VariantConfig.model_validate({"steps": [{technique: choices}]})
            except ValidationError as exc:
                count, reason = count + 1, reason or _refusal(technique, exc)
                continue
            name = _name(technique, choices)
            if any(candidate.name == name for candidate in candidates):
                raise ConfigError(
                    f"{SOURCE}.{technique}: two combinations would both be named {name!r}: {choices}"
                )
            candidates.append(Candidate(name, technique, choices, variant))
        if count:
            refused[technique] = (count, reason)
        if not any(candidate.technique == technique for candidate in candidates):
            raise ConfigError(f"{SOURCE}.{technique}: {technique} refuses every combination: {reason}")
    return Space(candidates, refused)


def _refusal(technique: str, exc: ValidationError) -> str:
    """A combination's refusal in words; a setting's own value refused (not the combination) is the user's error."""
    first = exc.errors()[0]
    loc = [part for part in first["loc"] if not (isinstance(part, str) and "[" in part)]
    message = first["msg"].removeprefix("Value error, ")
    # one setting's own value refused: wrong whatever it is combined with
    if len(loc) > 3 and loc[:3] == ["steps", 0, technique]:
        key = ".".join(str(part) for part in loc[3:])
        raise ConfigError(f"{SOURCE}.{technique}.{key}: {message}, got {first.get('input')!r}")
    return message


def _name(technique: str, choices: dict[str, Any]) -> str:
    """A readable, file-safe name from the choices, in the space's order: onnx_genai-int4-b64 style."""
    parts = [technique, *(_short(key, value) for key, value in choices.items())]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts)).strip("-").lower()


def _short(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return key if value else f"no_{key}"
    if isinstance(value, dict):
        return key + "-" + "-".join(str(v) for v in value.values())
    return f"{key}{value}" if isinstance(value, int | float) else str(value)


def _hint(word: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(word, allowed, n=1) or [
        name for name in allowed if name.startswith(word)
    ]
    return (
        f" (did you mean {close[0]!r}?); allowed: {', '.join(allowed)}"
        if close
        else f"; allowed: {', '.join(allowed)}"
    )


def variant_block(candidate: Candidate) -> str:
    """The candidate as a `variants:` entry of params.yaml (indented for that section), ready to paste or keep."""
    steps = [{candidate.technique: candidate.choices}]  # as the space was written, defaults left out
    recipe = {candidate.name: {"steps": steps}}
    text = yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None, width=110)
    return "".join(f"  {line}\n" for line in text.splitlines())

"""Reading params.yaml into the Config: YAML errors with their line, profile files (`extends:`), and every
validation problem as one ConfigError line naming the dotted key path (with a did-you-mean for unknown keys)."""

from __future__ import annotations

import difflib
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks import plugins
from tasks.config import RuntimeSettings
from tasks.errors import ConfigError
from tasks.params import Config
from tasks.techniques import registry


def load_config(path: Path, notice: Callable[[str], None] | None = None) -> Config:
    """Read and validate params.yaml; every problem becomes one ConfigError line naming the key path. A setting
    spelled the former way works and is named to `notice` (default: one line on stderr)."""
    notice = notice or _print_notice
    if plugins.LOAD_PROBLEMS:  # a plug-in module that failed to load: the schema lacks its steps
        raise ConfigError(plugins.LOAD_PROBLEMS[0])
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of sections, got {type(raw).__name__}")
    if "extends" in raw:
        raw = _extend(path, raw)
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(path.name, exc)) from None
    for line in former_spellings(path.name, raw):
        notice(line)
    return config


def former_spellings(source: str, raw: dict[str, Any]) -> list[str]:
    """One deprecation line per renamed setting params.yaml still spells the former way (it keeps working)."""
    lines = []
    loadtest = raw.get("loadtest")
    if isinstance(loadtest, dict) and "slo" in loadtest:
        lines.append(
            f"{source}: loadtest.slo → slo (one SLO for the load test and select.objective: serving; the former "
            "place still works, for now)"
        )
    variants = raw.get("variants")
    for name, variant in (variants if isinstance(variants, dict) else {}).items():
        if not isinstance(variant, dict):
            continue
        sections = [("runtime", RuntimeSettings, variant.get("runtime"))]
        for index, step in enumerate(variant.get("steps") or []):
            for kind, settings in (step if isinstance(step, dict) else {}).items():
                if kind in registry.TECHNIQUES:
                    sections.append((f"steps[{index}].{kind}", registry.technique(kind).settings, settings))
        for where, schema, data in sections:
            for change in schema.former_spellings(data):
                lines.append(
                    f"{source}: variants.{name}.{where}: {change} (the former spelling still works, for now)"
                )
    return lines


def _print_notice(line: str) -> None:
    print(f"deprecated: {line}", file=sys.stderr)


def _extend(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A profile file: `extends: params.yaml` plus the sections it changes (keys merged into the base's sections;
    variants added to, or replacing, the base's variants by name; a variant set to null is left out)."""
    base_path = path.parent / str(raw.pop("extends"))
    if base_path.resolve() == path.resolve():
        raise ConfigError(f"{path}: extends: names the file itself")
    base = yaml.safe_load(base_path.read_text()) if base_path.is_file() else None
    if not isinstance(base, dict) or "extends" in base:
        raise ConfigError(f"{path}: extends: {base_path} must be a plain params file (one level of extends)")
    for section, values in raw.items():
        merged = isinstance(values, dict) and isinstance(base.get(section), dict)
        base[section] = {**base[section], **values} if merged else values
    if isinstance(base.get("variants"), dict):
        base["variants"] = {name: recipe for name, recipe in base["variants"].items() if recipe is not None}
    return base


def describe_validation_error(source: str, exc: ValidationError) -> str:
    """One line for the first validation problem, with the dotted key path and what was expected."""
    errors = exc.errors()
    first = errors[0]
    loc = [part for part in first["loc"] if not _is_pydantic_branch(part)]
    key = _format_loc(loc)
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        detail = (
            f"unknown key{f' (did you mean {hint[0]!r}?)' if hint else ''}; allowed: {', '.join(allowed)}"
        )
    else:
        got = first.get("input")
        detail = f"{first['msg'].removeprefix('Value error, ')}"
        if first["type"] not in ("missing", "value_error") and not isinstance(got, dict):
            detail += f", got {got!r}"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {key or '<top level>'}: {detail}{more}"


def _is_pydantic_branch(part: Any) -> bool:
    """Union/literal branch labels pydantic inserts into error locations (e.g. 'function-after[...]')."""
    return isinstance(part, str) and "[" in part


def _format_loc(loc: list[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _allowed_keys(loc: list[Any]) -> list[str]:
    """Field names of the config section found by walking `loc` from Config (dict keys and indexes skipped)."""
    current: Any = Config
    for part in loc:
        if isinstance(part, int):
            current = _unwrap(current, list)
        elif isinstance(current, type) and issubclass(current, BaseModel):
            current = current.model_fields[part].annotation
        else:
            current = _unwrap(current, dict)
    current = _unwrap(current, None)
    return (
        sorted(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []
    )


def _unwrap(annotation: Any, container: type | None) -> Any:
    """The model type inside `list[X]`, `dict[str, X]` or `X | None`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if container is not None and origin is container:
        return args[-1]
    if origin in (typing.Union, types.UnionType):
        return next(arg for arg in args if arg is not type(None))
    return annotation

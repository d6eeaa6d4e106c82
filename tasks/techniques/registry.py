"""The technique registry: every recipe step kind, declared once, in the module that implements it.

A technique is a `Technique` subclass decorated with `@register`: its step key in params.yaml, its settings model
(with every default), its role in a recipe, how it applies or exports, what it stores (bits per weight for the
report), what it needs (packages) and what a target cannot run of it. The recipe schema (`tasks.params.Step`), the
order rules, the target checks, the report's bit column, a registered model's requirements and the docs'
technique table are all derived from this registry; no other module lists techniques.

This module is the contract the technique modules import; which modules exist and their loading (the built-in
ones, the `llmopt.techniques` entry-point group, `$LLMOPT_TECHNIQUES`) is tasks/techniques/catalog.py's. Adding a
technique is one module with its tests, and one line in the catalog's `BUILT_IN` or in its package's entry points.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from tasks.errors import ConfigError
from tasks.schema import Strict

if TYPE_CHECKING:
    from tasks.config import ModelConfig, TargetConfig
    from tasks.engines.manifest import VariantManifest

Role = Literal["transform", "quantize", "export"]


class ConfigView(Protocol):
    """What a technique's target check reads of the configuration (`tasks.params.Config` is one): the registry
    sits below the recipe schema it feeds, so it names the sections, not the whole object."""

    @property
    def target(self) -> TargetConfig: ...

    @property
    def model(self) -> ModelConfig: ...


@dataclass(frozen=True)
class Applied:
    """What a torch-side step returns: the changed model, the weights format to save it in, a note for humans."""

    model: Any
    weights_format: str
    note: str
    record: dict[str, Any] | None = (
        None  # what the weights format stores beside the model (an on-load record)
    )


@dataclass(frozen=True)
class ExportJob:
    """What an export step needs besides its settings and the model (None: the step said it needs none)."""

    base_path: Path  # the prepared base model folder
    dest: Path  # the staging folder the variant is written into (the runner saves the tokenizer afterwards)
    context: Any  # tasks.techniques.build.BuildContext
    changed: bool  # earlier steps changed the float model (so the base folder is not what to export)


@dataclass(frozen=True)
class Exported:
    weights_format: str
    engine: str  # the engine that runs the variant (tasks.engines)
    notes: list[str]
    parameters: int | None = None  # when no float model was loaded (then read from the artifact)


@dataclass(frozen=True)
class Row:
    """One row of the technique table: how it is written, the settings whose defaults it shows, what it does."""

    usage: str
    settings: tuple[str, ...] = ()
    what: str = ""
    defaults_note: str = ""  # said after the defaults


class Technique:
    """One step kind. Subclasses set the class attributes and override what their role needs."""

    name: ClassVar[str]  # the step's key in params.yaml: `steps: [{<name>: {...}}]`
    settings: ClassVar[type[Strict]]
    # transform: float model → float model (before any quantize); quantize: float → quantized torch model (one
    # per variant, runtime.dtype left at float32); export: hands the model to another engine (last, one per variant)
    role: ClassVar[Role]
    engine_label: ClassVar[str] = ""  # export: the engine's name in messages ("ONNX Runtime GenAI")
    peer_note: ClassVar[str] = (
        ""  # what the step is when it needs no model (`needs_model` False), for messages
    )

    def apply(self, model: Any, settings: Any, context: Any) -> Applied:
        raise NotImplementedError(f"{self.name} is an export; the runner calls export()")

    def export(self, model: Any, settings: Any, job: ExportJob) -> Exported:
        raise NotImplementedError(f"{self.name} runs on the torch model; the runner calls apply()")

    def needs_model(self, settings: Any) -> bool:
        """Whether the step works on the loaded float model (False: it copies something as is)."""
        return True

    def weight_bits(self, settings: Any, manifest: VariantManifest) -> int | None:
        """Bits per weight of what the step stores (None: it leaves the precision as it was)."""
        return None

    def packages(self, settings: Any) -> list[str]:
        """pip packages a registered variant built with these settings needs to load (beyond the serving set)."""
        return []

    def problems(self, where: str, settings: Any, config: ConfigView, cuda_available: bool) -> list[str]:
        """What the target cannot run of these settings, as 'key: why; alternative' lines (`where` is the key)."""
        return []

    def rows(self) -> list[Row]:
        """The technique table's rows (default: one, from the settings model's docstring)."""
        doc = " ".join((self.settings.__doc__ or "").split())
        return [Row(f"`{self.name}`", tuple(self.settings.model_fields), doc)]


class StepArgumentError(ValueError):
    """A step's settings do not fit this model (e.g. more head groups removed than it has)."""


@contextlib.contextmanager
def step_arguments(kind: str) -> Iterator[None]:
    """The technique modules raise ValueError naming the argument; that is the user's setting, not a bug."""
    try:
        yield
    except ValueError as exc:
        raise StepArgumentError(f"{kind}.{exc}") from exc


def save_float_model(model: Any, tokenizer: Any, folder: Path) -> Path:
    """The changed float model as an HF folder (what an exporter reads, the tokenizer included)."""
    from tasks.inputs.load import save_tokenizer

    model.save_pretrained(folder / "model")
    save_tokenizer(tokenizer, folder / "model")
    return folder / "model"


TECHNIQUES: dict[str, Technique] = {}


def register(cls: type[Technique]) -> type[Technique]:
    """Class decorator: add a technique to the registry under its `name`."""
    existing = TECHNIQUES.get(cls.name)
    if existing is not None and type(existing).__qualname__ != cls.__qualname__:
        raise ConfigError(
            f"technique {cls.name!r} is registered twice ({type(existing).__module__} and {cls.__module__})"
        )
    for attribute in ("name", "settings", "role"):
        if not hasattr(cls, attribute):
            raise TypeError(f"{cls.__qualname__}: a technique declares {attribute}")
    TECHNIQUES[cls.name] = cls()
    return cls


def technique(name: str) -> Technique:
    return TECHNIQUES[name]


def recorded_settings(name: str, settings: dict[str, Any]) -> tuple[Technique, Any] | None:
    """A recorded step (from a manifest or the registry) read back: (technique, settings), or None when no loaded
    technique has that name or the settings no longer validate (a recipe of another llmopt version)."""
    from pydantic import ValidationError

    entry = TECHNIQUES.get(name)
    if entry is None:
        return None
    try:
        return entry, entry.settings.model_validate(settings)
    except ValidationError:
        return None


def of_role(role: Role) -> list[str]:
    return [name for name, entry in TECHNIQUES.items() if entry.role == role]


def defaults_text(settings: type[Strict], names: tuple[str, ...]) -> str:
    """`name: default` for each named setting, as the technique table shows them."""
    import json

    shown = []
    for name in names:
        section, _, leaf = name.rpartition(".")  # `mixed_precision.windows`: a nested section's setting
        model = settings
        if section:
            annotation = settings.model_fields[section].annotation
            model = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
        setting = model.model_fields[leaf]
        default = setting.default
        if setting.is_required() or default is None or isinstance(default, Strict):
            continue  # no default to show (a method to choose, an optional section)
        value = (
            json.dumps(default)
            if isinstance(default, bool)
            else f"{default:g}"
            if isinstance(default, float)
            else default
        )
        shown.append(f"`{leaf}: {value}`")
    return ", ".join(shown)


def technique_table() -> str:
    """The docs' technique table (docs/techniques.md) (markdown), from every registered technique's rows."""
    lines = ["| step | settings (defaults) | what it does, honestly |", "|---|---|---|"]
    for entry in TECHNIQUES.values():
        for row in entry.rows():
            defaults = defaults_text(entry.settings, row.settings)
            defaults = " ".join(part for part in (defaults, row.defaults_note) if part) or "—"
            lines.append(f"| {row.usage} | {defaults} | {row.what} |")
    return "\n".join(lines)


TABLE_START, TABLE_END = "<!-- techniques: generated by `make techniques-table` -->", "<!-- /techniques -->"


def write_table_into(document: Path) -> None:
    """Replace the generated technique table in `document` (between the two markers) by the registry's."""
    text = document.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    document.write_text(f"{text[:start]}\n{technique_table()}\n{text[end:]}")

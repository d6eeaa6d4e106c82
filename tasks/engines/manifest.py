"""The variant manifest: what a variant artifact is, how it was built and how to load it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.config import RuntimeSettings
from tasks.errors import ModelSourceError
from tasks.storage import file_sha256

MANIFEST_FILE = "manifest.json"
VARIANT_ARTIFACT = "variant"  # the artifact under which a registered MLflow model carries its variant folder


@dataclass(frozen=True)
class VariantManifest:
    """Written beside every variant's weights; the runtime reads it to know how to load them."""

    name: str
    recipe: dict
    recipe_hash: str
    build_key: str
    base_hash: str
    data_hash: str
    weights_format: str  # one of the formats its engine module loads (e.g. "hf-safetensors", "onnx-genai")
    dtype: str
    engine: str
    parameters: int
    size_bytes: int
    content_hash: str
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    training: dict[str, list[float]] = field(default_factory=dict)  # per-step losses (distill, heal)

    def runtime_settings(self) -> RuntimeSettings:
        """The recipe's runtime settings, as validated when the variant was built."""
        return RuntimeSettings.model_validate(self.recipe.get("runtime", {}))

    @property
    def model_hash(self) -> str:
        """Identity of the model as it runs: its bytes plus its resolved runtime settings (variants that differ
        only in attention, KV cache, window or engine share their bytes, not their behaviour)."""
        settings = json.dumps(self.runtime_settings().model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(f"{self.content_hash}\0{settings}".encode()).hexdigest()

    def write(self, folder: Path) -> None:
        (folder / MANIFEST_FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")


def read_manifest(folder: Path) -> VariantManifest:
    """The manifest of a variant folder; a missing or unreadable one is a clear ModelSourceError."""
    path = folder / MANIFEST_FILE
    try:
        return VariantManifest(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise ModelSourceError(f"{folder}: no {MANIFEST_FILE}; not an llmopt variant folder") from None
    except (ValueError, TypeError) as exc:
        raise ModelSourceError(f"{path}: unreadable manifest ({exc})") from None


def same_tokenizer(folder: Path, other: Path) -> bool:
    """Whether two variant folders carry byte-identical tokenizers (so the same text gives the same ids)."""
    files = [folder / "tokenizer.json", other / "tokenizer.json"]
    return all(f.is_file() for f in files) and file_sha256(files[0]) == file_sha256(files[1])

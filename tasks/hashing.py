"""Content hashes for folders and files: what makes builds reusable and lineage traceable."""

import hashlib
from pathlib import Path

_CHUNK = 8 * 1024 * 1024


def file_sha256(path: Path) -> str:
    """SHA-256 of one file, read in chunks so multi-GB weights do not sit in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_sha256(folder: Path, exclude: tuple[str, ...] = ()) -> str:
    """SHA-256 over the relative names and contents of every file in `folder`, independent of walk order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative in exclude:
            continue
        digest.update(relative.encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def folder_size(folder: Path) -> int:
    """Total bytes of the files in `folder` (what the artifact costs on disk)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

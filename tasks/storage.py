"""Bytes on disk: content hashes (what makes builds reusable and lineage traceable) and staged writes (what
keeps an interrupted run from leaving a half-written folder or file behind under its final name)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
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


def code_sha256(modules: tuple[str, ...]) -> str:
    """SHA-256 of the source of the named modules (a package counts with every .py file in its folder), found
    by import name so keys that include code survive files moving between folders."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"code key: no module {name}")
        origin = Path(spec.origin)
        files = sorted(origin.parent.glob("*.py")) if spec.submodule_search_locations else [origin]
        for path in files:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def staging_path(dest: Path) -> Path:
    """Where `dest` is written before it is renamed into place."""
    return dest.with_name(dest.name + ".partial")


@contextlib.contextmanager
def staged_folder(dest: Path) -> Iterator[Path]:
    """Yield an empty `<dest>.partial` folder to write into; when the body succeeds it replaces `dest`, when it
    fails (or is interrupted) it is removed. `dest` is never seen half-written."""
    staging = staging_path(dest)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)


@contextlib.contextmanager
def staged_file(dest: Path) -> Iterator[Path]:
    """Yield `<dest>.partial` to write; when the body succeeds it atomically replaces `dest`, when it fails it is
    removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(dest)
    try:
        yield staging
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    os.replace(staging, dest)

"""Bytes on disk: content hashes (what makes builds reusable and lineage traceable) and staged writes (what
keeps an interrupted run from leaving a half-written folder or file behind under its final name)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from tasks.errors import StorageError, exception_chain

_CHUNK = 8 * 1024 * 1024
_RACY_NS = 2_000_000_000


def file_sha256(path: Path) -> str:
    """SHA-256 of one file, read in chunks so multi-GB weights do not sit in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(folder: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """SHA-256 of every file in `folder` by relative name (sorted), each read once per change: a file whose
    inode, size, mtime and ctime are those it had when last hashed is not read again (see `HashCache`)."""
    cache = HashCache.default()
    hashes = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative not in exclude:
            hashes[relative] = cache.sha256(path)
    return hashes


def combined_sha256(hashes: dict[str, str]) -> str:
    """One hash over files' relative names and hashes (what `folder_sha256` returns for them)."""
    digest = hashlib.sha256()
    for relative, sha in sorted(hashes.items()):
        digest.update(relative.encode() + b"\0" + sha.encode() + b"\n")
    return digest.hexdigest()


def folder_sha256(folder: Path, exclude: tuple[str, ...] = ()) -> str:
    """SHA-256 over the relative names and contents of every file in `folder`, independent of walk order."""
    return combined_sha256(file_hashes(folder, exclude))


def first_difference(actual: dict[str, str], recorded: dict[str, str]) -> tuple[str, str, str] | None:
    """(file, its hash now, the recorded hash) of the first file that differs; '(missing)' / '(not recorded)'
    stand for a file on one side only. None when both agree."""
    for name in sorted(set(actual) | set(recorded)):
        now, then = actual.get(name, "(missing)"), recorded.get(name, "(not recorded)")
        if now != then:
            return name, now, then
    return None


class HashCache:
    """Remembered file hashes, keyed by device and inode and valid while size, mtime and ctime are unchanged.

    ctime cannot be set back by a user (unlike mtime with `touch -r`), so a rewritten file is always read again.
    Keys survive renames (a staged folder moved into place keeps its hashes). The cache is a small SQLite file
    ($LLMOPT_HASH_CACHE, default ~/.cache/llmopt/file-hashes.sqlite); when it cannot be opened or written,
    every file is simply hashed.
    """

    _default: HashCache | None = None

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @classmethod
    def default(cls) -> HashCache:
        location = os.environ.get("LLMOPT_HASH_CACHE") or str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmopt" / "file-hashes.sqlite"
        )
        if cls._default is None or str(cls._default.path) != location:
            cls._default = cls(Path(location) if location != "off" else None)
        return cls._default

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        key = f"{stat.st_dev}:{stat.st_ino}"
        state = f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
        known = self._lookup(key, state)
        if known is not None:
            return known
        sha = file_sha256(path)
        if time.time_ns() - stat.st_ctime_ns > _RACY_NS:  # a file changed this very second may change again
            self._store(key, state, sha)  # within the same timestamp tick: such hashes are not remembered
        return sha

    def _connect(self):
        import sqlite3

        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=30)
        connection.execute(
            "create table if not exists hashes (key text primary key, state text, sha256 text)"
        )
        return connection

    def _lookup(self, key: str, state: str) -> str | None:
        import sqlite3

        if self.path is None:
            return None
        try:
            with contextlib.closing(self._connect()) as connection:
                row = connection.execute("select state, sha256 from hashes where key = ?", (key,)).fetchone()
        except (sqlite3.Error, OSError):
            return None
        return row[1] if row is not None and row[0] == state else None

    def _store(self, key: str, state: str, sha: str) -> None:
        import sqlite3

        if self.path is None:
            return
        try:
            with contextlib.closing(self._connect()) as connection, connection:
                connection.execute("insert or replace into hashes values (?, ?, ?)", (key, state, sha))
        except (sqlite3.Error, OSError):
            pass  # a cache that cannot be written only costs time


def folder_size(folder: Path) -> int:
    """Total bytes of the files in `folder` (what the artifact costs on disk)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def code_sha256(modules: tuple[str, ...], skip: tuple[str, ...] = ()) -> str:
    """SHA-256 of the source of the named modules (a package counts with every .py file in its folder and its
    subpackages, but the modules in `skip`), found by import name so keys that include code survive files moving
    between folders."""
    skipped = {Path(_module_spec(name).origin) for name in skip}
    digest = hashlib.sha256()
    for name in modules:
        spec = _module_spec(name)
        origin = Path(spec.origin)
        files = sorted(origin.parent.rglob("*.py")) if spec.submodule_search_locations else [origin]
        for path in files:
            if path not in skipped:
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _module_spec(name: str) -> importlib.machinery.ModuleSpec:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"code key: no module {name}")
    return spec


def staging_path(dest: Path) -> Path:
    """Where `dest` is written before it is renamed into place."""
    return dest.with_name(dest.name + ".partial")


@contextlib.contextmanager
def staged_folder(dest: Path) -> Iterator[Path]:
    """Yield an empty `<dest>.partial` folder to write into; when the body succeeds it replaces `dest`, when it
    fails (or is interrupted) it is removed. `dest` is never seen half-written. A full disk is a StorageError
    naming `dest` (libraries report it in many shapes: OSError, RuntimeError, their own errors)."""
    staging = staging_path(dest)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        yield staging
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if disk_full(exc):
            raise _disk_full_error(dest) from exc
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)


def disk_full(exc: BaseException) -> bool:
    """Whether an exception (or one it was raised from) says the disk is full or over quota."""
    return any(
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
        or "No space left on device" in str(e)
        or "Disk quota exceeded" in str(e)
        for e in exception_chain(exc)
    )


def _disk_full_error(dest: Path) -> StorageError:
    free = shutil.disk_usage(dest.parent).free / 1e6
    return StorageError(
        f"{dest}: the disk filled up while writing it ({free:.0f} MB free after removing the partial copy); "
        "free space on that disk and run again"
    )


@contextlib.contextmanager
def staged_file(dest: Path) -> Iterator[Path]:
    """Yield `<dest>.partial` to write; when the body succeeds it atomically replaces `dest`, when it fails it is
    removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(dest)
    try:
        yield staging
    except BaseException as exc:
        staging.unlink(missing_ok=True)
        if disk_full(exc):
            raise _disk_full_error(dest) from exc
        raise
    os.replace(staging, dest)
